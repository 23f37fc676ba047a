"""Tensors on the wire as raw bytes + dtype + shape (never pickle).

Weights travel as a sequence of `WeightBucket` messages (proto/dapo/v1/tensor.proto).
`encode_buckets` splits named tensors into buckets of at most `bucket_bytes` payload;
`WeightAssembler` (services/weight_transport/assembly.py) rebuilds them, checked.
`encode_bucket_parts` / `encode_bucket_bytes` / `parse_bucket` are the same wire format
without protobuf copying the tensor bytes (docs/weight_publication.md).

The module is torch-free at import; `to_torch` / `from_torch` import torch lazily for
the processes that have it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
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
# A receiver allocates each tensor's buffer from its announced shape; a lying shape must
# get an error, not an out-of-memory kill.
MAX_TENSOR_BYTES = 16 << 30


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
    listed = list(tensors)
    for bucket, views in _plan(listed, version, bucket_bytes, len(listed)):
        for piece, view in zip(bucket.slices, views, strict=True):
            piece.data = bytes(view)
        yield bucket


# ---------------------------------------------------------------- zero-copy wire path
# `encode_bucket_bytes` / `parse_bucket` produce and read exactly the bytes of a
# serialized WeightBucket, but never copy tensor data through protobuf: the small
# metadata fields go through the generated classes, the `data` fields are spliced in
# (sender: one copy into the message) or viewed in place (receiver: a memoryview).
_SLICE_TAG, _DATA_TAG = b"\x22", b"\x32"  # WeightBucket.slices = 4, TensorSlice.data = 6
_SLICES_FIELD, _DATA_FIELD = 4, 6
SLICES_KEY, DATA_KEY = _SLICES_FIELD << 3 | 2, _DATA_FIELD << 3 | 2  # length-delimited keys


def _varint_bytes(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    """(value, position after it); TensorWireError when truncated or too long."""
    value = shift = 0
    while pos < len(buf) and shift < 64:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
    raise TensorWireError("malformed varint in weight bucket")


FIXED_WIDTHS = {1: 8, 5: 4}  # wire type → width (64-bit, 32-bit)


def _fields(buf: memoryview) -> Iterator[tuple[int, int, int, int]]:
    """(key, start of the key, start of the value, end) of each field of a message."""
    pos = 0
    while pos < len(buf):
        key, start = read_varint(buf, pos)
        wire_type = key & 7
        if wire_type == 0:
            end = read_varint(buf, start)[1]
        elif wire_type == 2:
            length, start = read_varint(buf, start)
            end = start + length
        elif wire_type in FIXED_WIDTHS:
            end = start + FIXED_WIDTHS[wire_type]
        else:
            raise TensorWireError(f"unsupported wire type {wire_type} in weight bucket")
        if end > len(buf):
            raise TensorWireError("weight bucket truncated")
        yield key, pos, start, end
        pos = end


def _split(buf: memoryview, big_field: int) -> tuple[bytes, list[memoryview]]:
    """Every field but the length-delimited `big_field` re-joined (for protobuf to parse
    and check), and views of each `big_field` value."""
    small, big = [], []
    for key, key_at, start, end in _fields(buf):
        if key == big_field << 3 | 2:
            big.append(buf[start:end])
        else:
            small.append(buf[key_at:end])
    return b"".join(small), big


@dataclass(frozen=True)
class SliceMeta:
    """A TensorSlice without its data: what a receiver needs to place the data."""

    name: str
    dtype: int
    shape: tuple[int, ...]
    offset: int
    total_bytes: int

    @classmethod
    def of(cls, piece: Any) -> SliceMeta:
        return cls(piece.name, piece.dtype, tuple(piece.shape), piece.offset, piece.total_bytes)


@dataclass(frozen=True)
class WireSlice(SliceMeta):
    """A TensorSlice whose `data` is a view into the received message (no copy)."""

    data: memoryview | bytes


@dataclass(frozen=True)
class WireBucket:
    """A WeightBucket as `parse_bucket` reads it; quacks like the generated message."""

    version: int
    index: int
    last: bool
    total_tensors: int
    slices: list[WireSlice]


def _parse_slice(buf: memoryview) -> WireSlice:
    meta, data = _split(buf, _DATA_FIELD)
    m = from_string(tensor_pb2.TensorSlice, meta)
    view = data[-1] if data else memoryview(b"")  # proto3: the last occurrence wins
    return WireSlice(m.name, m.dtype, tuple(m.shape), m.offset, m.total_bytes, view)


def from_string(message: Any, data: bytes) -> Any:
    try:
        return message.FromString(data)
    except Exception as exc:  # protobuf's DecodeError, kept out of callers' types
        raise TensorWireError(f"malformed {message.__name__}: {exc}") from exc


def parse_bucket(data: bytes | memoryview) -> WireBucket:
    """A serialized WeightBucket → WireBucket, tensor bytes viewed in place."""
    header, slices = _split(memoryview(data).cast("B"), _SLICES_FIELD)
    h = from_string(tensor_pb2.WeightBucket, header)
    pieces = [_parse_slice(s) for s in slices]
    return WireBucket(h.version, h.index, h.last, h.total_tensors, pieces)


def _slice_bytes(piece: tensor_pb2.TensorSlice, data: memoryview) -> list[bytes | memoryview]:
    """The serialized TensorSlice: protobuf for the metadata, then `data` spliced in."""
    meta = piece.SerializeToString()
    if not len(data):
        return [meta]
    return [meta, _DATA_TAG, _varint_bytes(len(data)), data]


def encode_bucket_parts(
    tensors: Iterable[RawTensor], version: int, bucket_bytes: int, total: int | None = None
) -> Iterator[list[bytes | memoryview]]:
    """`encode_buckets(...)` serialized without copying tensor data: each bucket a list of
    parts (metadata bytes, views into the tensors) that joins to exactly the message, for a
    scatter/gather send. With `total` (the tensors' number) `tensors` is consumed lazily."""
    if total is None:
        tensors = list(tensors)
        total = len(tensors)
    for bucket, views in _plan(tensors, version, bucket_bytes, total):
        yield _bucket_parts(bucket, list(bucket.slices), views)


def encode_bucket_bytes(
    tensors: Iterable[RawTensor], version: int, bucket_bytes: int, total: int | None = None
) -> Iterator[bytes]:
    """`encode_bucket_parts` joined: each bucket one `bytes` (one copy of the tensor data,
    so with `total` a tensor is let go once its last byte is in a bucket)."""
    for parts in encode_bucket_parts(tensors, version, bucket_bytes, total):
        yield b"".join(parts)


def wire_bucket_parts(bucket: WireBucket, views: list[memoryview]) -> list[bytes | memoryview]:
    """`bucket` serialized again (as `encode_bucket_bytes` would), with `views` as its
    slices' data: a relay forwards the bytes it assembled without joining them."""
    pieces = [
        tensor_pb2.TensorSlice(
            name=s.name, dtype=s.dtype, shape=s.shape, offset=s.offset, total_bytes=s.total_bytes
        )
        for s in bucket.slices
    ]
    return _bucket_parts(bucket, pieces, views)


def _bucket_parts(
    bucket: Any, pieces: list[tensor_pb2.TensorSlice], views: list[memoryview]
) -> list[bytes | memoryview]:
    """A WeightBucket's bytes in pieces: protobuf for the metadata, the data spliced in."""
    head = tensor_pb2.WeightBucket(version=bucket.version, index=bucket.index, last=bucket.last)
    parts: list[bytes | memoryview] = [head.SerializeToString()]  # fields 1-3
    for piece, view in zip(pieces, views, strict=True):  # field 4
        body = _slice_bytes(piece, view)
        parts += [_SLICE_TAG, _varint_bytes(sum(len(b) for b in body)), *body]
    tail = tensor_pb2.WeightBucket(total_tensors=bucket.total_tensors)  # field 5
    parts.append(tail.SerializeToString())
    return parts


def _plan(
    tensors: Iterable[RawTensor], version: int, bucket_bytes: int, total: int
) -> Iterator[tuple[tensor_pb2.WeightBucket, list[memoryview]]]:
    """The bucket layout of `encode_buckets`: data-less slices + the views they stand for."""
    bucket = tensor_pb2.WeightBucket(version=version, index=0, total_tensors=total)
    views: list[memoryview] = []
    room = bucket_bytes
    for raw in tensors:
        enum, view, offset = DTYPES[raw.dtype][0], memoryview(raw.data).cast("B"), 0
        while True:
            take = min(room, len(view) - offset)
            bucket.slices.add(
                name=raw.name, dtype=enum, shape=raw.shape, offset=offset, total_bytes=len(view)
            )
            views.append(view[offset : offset + take])
            offset, room = offset + take, room - take
            if room == 0:
                yield bucket, views
                index, views, room = bucket.index + 1, [], bucket_bytes
                bucket = tensor_pb2.WeightBucket(version=version, index=index, total_tensors=total)
            if offset >= len(view):
                break
    bucket.last = True
    yield bucket, views
