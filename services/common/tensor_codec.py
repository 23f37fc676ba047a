"""Tensors on the wire as raw bytes + dtype + shape (never pickle).

Weights travel as a sequence of `WeightBucket` messages (proto/dapo/v1/tensor.proto).
`encode_buckets` splits named tensors into buckets of at most `bucket_bytes` payload;
`WeightAssembler` rebuilds them and refuses anything inconsistent, so a receiver either
gets a complete, well-formed update or an error — never half an update.

The module is torch-free at import; `to_torch` / `from_torch` import torch lazily for
the processes that have it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from dapo.v1 import tensor_pb2

# dtype name → (proto enum, bytes per element)
DTYPES: dict[str, tuple[int, int]] = {
    "float32": (tensor_pb2.DTYPE_FLOAT32, 4),
    "float16": (tensor_pb2.DTYPE_FLOAT16, 2),
    "bfloat16": (tensor_pb2.DTYPE_BFLOAT16, 2),
    "float64": (tensor_pb2.DTYPE_FLOAT64, 8),
    "int64": (tensor_pb2.DTYPE_INT64, 8),
    "int32": (tensor_pb2.DTYPE_INT32, 4),
    "int16": (tensor_pb2.DTYPE_INT16, 2),
    "int8": (tensor_pb2.DTYPE_INT8, 1),
    "uint8": (tensor_pb2.DTYPE_UINT8, 1),
    "bool": (tensor_pb2.DTYPE_BOOL, 1),
}
DTYPE_NAMES: dict[int, str] = {enum: name for name, (enum, _) in DTYPES.items()}


class TensorWireError(ValueError):
    """A tensor or weight update on the wire is malformed or incomplete."""


@dataclass(frozen=True)
class RawTensor:
    """A named tensor as row-major little-endian bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: bytes | memoryview

    def __post_init__(self) -> None:
        expected = expected_nbytes(self.dtype, self.shape)
        if len(self.data) != expected:
            raise TensorWireError(
                f"{self.name}: {len(self.data)} bytes but {self.dtype}{list(self.shape)} "
                f"needs {expected}"
            )


def expected_nbytes(dtype: str, shape: Iterable[int]) -> int:
    """Bytes a tensor of this dtype and shape occupies."""
    if dtype not in DTYPES:
        raise TensorWireError(f"unsupported dtype {dtype!r}")
    dims = list(shape)
    if any(d < 0 for d in dims):
        raise TensorWireError(f"negative dimension in shape {dims}")
    return math.prod(dims) * DTYPES[dtype][1]


def encode_buckets(
    tensors: Iterable[RawTensor], version: int, bucket_bytes: int
) -> Iterator[tensor_pb2.WeightBucket]:
    """Split tensors into WeightBuckets of at most bucket_bytes payload (tensors may span)."""
    tensors = list(tensors)
    bucket = tensor_pb2.WeightBucket(version=version, index=0, total_tensors=len(tensors))
    room = bucket_bytes
    for raw in tensors:
        enum = DTYPES[raw.dtype][0]
        view = memoryview(raw.data).cast("B")
        offset = 0
        while True:
            take = min(room, len(view) - offset)
            whole = take == len(view) and isinstance(raw.data, bytes)  # no copy to slice
            bucket.slices.add(
                name=raw.name, dtype=enum, shape=raw.shape, offset=offset, total_bytes=len(view),
                data=raw.data if whole else bytes(view[offset : offset + take]),
            )  # fmt: skip
            offset += take
            room -= take
            if room == 0:
                yield bucket
                bucket = tensor_pb2.WeightBucket(
                    version=version, index=bucket.index + 1, total_tensors=len(tensors)
                )
                room = bucket_bytes
            if offset >= len(view):
                break
    bucket.last = True
    yield bucket


@dataclass
class _Partial:
    """The slices of one tensor so far; joined once at the end (one copy, no zero-fill)."""

    dtype: str
    shape: tuple[int, ...]
    total: int
    chunks: list[bytes] = field(default_factory=list)
    filled: int = 0


@dataclass
class WeightAssembler:
    """Collects the buckets of one update; `result()` only once every byte arrived."""

    version: int | None = None
    next_index: int = 0
    total_tensors: int | None = None
    complete: bool = False
    _tensors: dict[str, _Partial] = field(default_factory=dict)

    def add(self, bucket: tensor_pb2.WeightBucket) -> None:
        """Take the next bucket; raise TensorWireError on anything inconsistent."""
        if self.complete:
            raise TensorWireError("bucket after the last one")
        if self.version is None:
            self.version, self.total_tensors = bucket.version, bucket.total_tensors
        if bucket.version != self.version:
            raise TensorWireError(f"bucket for version {bucket.version} inside {self.version}")
        if bucket.index != self.next_index:
            raise TensorWireError(f"bucket {bucket.index} out of order (want {self.next_index})")
        self.next_index += 1
        for piece in bucket.slices:
            self._add_slice(piece)
        self.complete = bucket.last

    def _add_slice(self, piece: tensor_pb2.TensorSlice) -> None:
        dtype = DTYPE_NAMES.get(piece.dtype)
        if dtype is None:
            raise TensorWireError(f"{piece.name}: unknown dtype enum {piece.dtype}")
        shape = tuple(piece.shape)
        total = expected_nbytes(dtype, shape)
        if piece.total_bytes != total:
            raise TensorWireError(f"{piece.name}: total_bytes {piece.total_bytes} != {total}")
        part = self._tensors.setdefault(piece.name, _Partial(dtype, shape, total))
        if (part.dtype, part.shape) != (dtype, shape):
            raise TensorWireError(f"{piece.name}: dtype/shape changed between slices")
        data = piece.data  # each access copies: read it once
        end = piece.offset + len(data)
        if piece.offset != part.filled or end > total:
            raise TensorWireError(f"{piece.name}: slice at {piece.offset} does not follow")
        part.chunks.append(data)
        part.filled = end

    def result(self) -> list[RawTensor]:
        """The complete tensors, in arrival order."""
        if not self.complete:
            raise TensorWireError("update incomplete: the last bucket never arrived")
        if self.total_tensors != len(self._tensors):
            raise TensorWireError(
                f"update holds {len(self._tensors)} tensors, announced {self.total_tensors}"
            )
        short = [n for n, p in self._tensors.items() if p.filled != p.total]
        if short:
            raise TensorWireError(f"incomplete tensors: {', '.join(short[:5])}")
        return [
            RawTensor(n, p.dtype, p.shape, bytearray().join(p.chunks))
            for n, p in self._tensors.items()
        ]


def from_torch(name: str, tensor: Any) -> RawTensor:
    """A torch tensor → RawTensor (copies to CPU, contiguous)."""
    import torch

    t = tensor.detach().to("cpu").contiguous()
    dtype = str(t.dtype).removeprefix("torch.")
    data = t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return RawTensor(name, dtype, tuple(t.shape), data)


def to_torch(raw: RawTensor) -> Any:
    """RawTensor → a CPU torch tensor.

    A bytearray (what `WeightAssembler` returns) is used in place, not copied: the tensor
    shares its memory. Other buffers are copied so the tensor owns writable memory.
    """
    import torch

    dtype = getattr(torch, raw.dtype)
    if not len(raw.data):
        return torch.empty(raw.shape, dtype=dtype)
    buf = raw.data if isinstance(raw.data, bytearray) else bytearray(raw.data)
    flat = torch.frombuffer(buf, dtype=torch.uint8)
    return flat.view(dtype).reshape(raw.shape)


def assemble_update(buckets: Iterable[tensor_pb2.WeightBucket]) -> tuple[int, list[RawTensor]]:
    """Receive a whole update: (version, tensors), or TensorWireError if incomplete."""
    assembler = WeightAssembler()
    for bucket in buckets:
        assembler.add(bucket)
    return assembler.version or 0, assembler.result()
