"""Assembling a weight update from its buckets: all of it, checked, or an error.

`WeightAssembler` rebuilds tensors from `WeightBucket`s (generated messages or
`parse_bucket`'s WireBuckets) and refuses anything inconsistent, so a receiver either
gets a complete, well-formed update or an error, never half an update. A reader that
knows a slice's metadata before its data (services/weight_transport/frame_reader.py) asks
`reserve` where the data go and receives them straight into the tensor: no copy.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from dapo.v1 import tensor_pb2
from services.weight_transport.recycled import RECEIVED
from services.weight_transport.tensor_codec import (
    DTYPE_NAMES,
    MAX_TENSOR_BYTES,
    RawTensor,
    SliceMeta,
    TensorWireError,
    WireBucket,
    WireSlice,
    expected_nbytes,
    parse_bucket,
)

Bucket: TypeAlias = tensor_pb2.WeightBucket | WireBucket
"""One bucket of an update: a generated message (the FetchWeights stream, `encode_buckets`)
or `parse_bucket`'s WireBucket (a socket frame)."""


@dataclass
class _Partial:
    """One tensor being received: its final buffer, filled slice by slice in place."""

    dtype: str
    shape: tuple[int, ...]
    total: int
    buffer: Any  # a numpy uint8 array
    filled: int = 0


@dataclass
class WeightAssembler:
    """Collects the buckets of one update; `result()` only once every byte arrived.

    Takes generated `WeightBucket` messages or `parse_bucket`'s WireBuckets. Each slice
    is copied once, straight into its tensor's final buffer, so a received message can
    be freed (and its memory reused for the next one) as soon as it was added.
    """

    version: int | None = None
    next_index: int = 0
    total_tensors: int | None = None
    complete: bool = False
    max_tensor_bytes: int = MAX_TENSOR_BYTES
    _tensors: dict[str, _Partial] = field(default_factory=dict)
    _completed: list[str] = field(default_factory=list)
    allocate: Callable[[int], Any] = RECEIVED.take  # a tensor's uninitialized uint8 array
    # called with (bucket, the slices' views in their tensors) once a bucket is copied in
    on_bucket: Callable[[Any, list[memoryview]], None] | None = None

    def add(self, bucket: Bucket) -> None:
        """Take the next bucket; raise TensorWireError on anything inconsistent."""
        self._check_bucket(bucket)
        views = [self._add_slice(piece) for piece in bucket.slices]
        self._took(bucket, views)

    def add_placed(self, bucket: WireBucket, views: list[memoryview]) -> None:
        """Take the next bucket whose slices were already written where `reserve` said
        (`views`, in order): the bucket-level checks of `add`, no copy."""
        self._check_bucket(bucket)
        self._took(bucket, views)

    def _check_bucket(self, bucket: Bucket) -> None:
        if self.complete:
            raise TensorWireError("bucket after the last one")
        if self.version is None:
            self.version, self.total_tensors = bucket.version, bucket.total_tensors
        if bucket.version != self.version:
            raise TensorWireError(f"bucket for version {bucket.version} inside {self.version}")
        if bucket.total_tensors != self.total_tensors:
            raise TensorWireError(
                f"bucket {bucket.index} announces {bucket.total_tensors} tensors, "
                f"the first announced {self.total_tensors}"
            )
        if bucket.index != self.next_index:
            raise TensorWireError(f"bucket {bucket.index} out of order (want {self.next_index})")
        self.next_index += 1

    def _took(self, bucket: Any, views: list[memoryview]) -> None:
        self.complete = bucket.last
        if self.on_bucket is not None:
            self.on_bucket(bucket, views)

    def _add_slice(self, piece: tensor_pb2.TensorSlice | WireSlice) -> memoryview:
        data = piece.data  # a protobuf message copies on each access: read it once
        view = self.reserve(SliceMeta.of(piece), len(data))
        view[:] = data  # the one copy, into the tensor's final buffer
        return view

    def reserve(self, meta: SliceMeta, length: int) -> memoryview:
        """Where the `length` data bytes of the slice `meta` go in its tensor, after every
        check a slice gets; they count as written (the caller fills the view, e.g. with
        `recv_into` straight from a socket, before the update is used)."""
        dtype = DTYPE_NAMES.get(meta.dtype)
        if dtype is None:
            raise TensorWireError(f"{meta.name}: unknown dtype enum {meta.dtype}")
        total = expected_nbytes(dtype, meta.shape)
        if meta.total_bytes != total:
            raise TensorWireError(f"{meta.name}: total_bytes {meta.total_bytes} != {total}")
        part = self._tensors.get(meta.name) or self._start(meta.name, dtype, meta.shape, total)
        if (part.dtype, part.shape) != (dtype, meta.shape):
            raise TensorWireError(f"{meta.name}: dtype/shape changed between slices")
        end = meta.offset + length
        if meta.offset != part.filled or end > total:
            raise TensorWireError(f"{meta.name}: slice at {meta.offset} does not follow")
        part.filled = end
        if end == total:
            self._completed.append(meta.name)
        return memoryview(part.buffer)[meta.offset : end]

    def pop_completed(self) -> list[RawTensor]:
        """The tensors completed since the last call (to check them while more arrive)."""
        done, self._completed = self._completed, []
        return [self._raw(name) for name in done]

    def _raw(self, name: str) -> RawTensor:
        p = self._tensors[name]
        return RawTensor(name, p.dtype, p.shape, memoryview(p.buffer))

    def _start(self, name: str, dtype: str, shape: tuple[int, ...], total: int) -> _Partial:
        """The tensor's final buffer, sized from its announced shape (bounded first)."""
        if total > self.max_tensor_bytes:
            raise TensorWireError(f"{name}: {total} bytes exceeds {self.max_tensor_bytes}")
        # not zeroed (every byte gets written by a slice; zero-filling cost as much as the
        # copy), and memory a collected version used: no fresh pages to fault in
        part = self._tensors[name] = _Partial(dtype, shape, total, self.allocate(total))
        return part

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
        return [self._raw(name) for name in self._tensors]


def assemble_update(buckets: AssembledBuckets) -> tuple[int, list[RawTensor]]:
    """Receive a whole update: (version, tensors), or TensorWireError if incomplete."""
    for _ in buckets:
        pass
    return buckets.assembler.version or 0, buckets.assembler.result()


Assembled = tuple[Bucket, list[RawTensor]]
"""A bucket taken into an assembler, and the tensors it completed (to check them while
the next bucket arrives)."""


class AssembledBuckets(ABC):
    """An update's buckets, each taken into `assembler` as it is iterated and yielded as
    `Assembled`; the update is `assembler.result()` once they are all through. What a
    weight source hands its receiver, whatever the transport."""

    assembler: WeightAssembler

    @abstractmethod
    def __iter__(self) -> Iterator[Assembled]: ...

    def abandon(self, error: BaseException) -> None:
        """The receiver gave up on this update (a stale version, a bad tensor, a broken
        transfer): stop what still feeds it. By default that is `close`."""
        self.close()

    @abstractmethod
    def close(self) -> None:
        """Release the transport now (a socket), also after an early stop, rather than
        when the iterator is collected."""


class Assembling(AssembledBuckets):
    """WeightBuckets (generated or parsed), taken into `assembler` as they are iterated."""

    def __init__(self, buckets: Iterable[Bucket], assembler: WeightAssembler | None = None) -> None:
        self.assembler = assembler or WeightAssembler()
        self._buckets = buckets

    @classmethod
    def of_frames(
        cls, frames: Iterable[bytes | memoryview], assembler: WeightAssembler | None = None
    ) -> Assembling:
        """Serialized buckets (socket frames, a relay's log) parsed as they are iterated."""
        return cls(map(parse_bucket, frames), assembler)

    def __iter__(self) -> Iterator[Assembled]:
        for bucket in self._buckets:
            self.assembler.add(bucket)
            yield bucket, self.assembler.pop_completed()

    def close(self) -> None:
        """Nothing to release: the buckets' stream is its caller's."""
