"""Host snapshots of the weights, pooled: what the learner serves each version from.

The weight socket sends a version's bytes straight out of its snapshot, so a snapshot
must stay untouched while any reader may still stream it; a fresh one per version would
fault in new pages (about 2 s per GB here) every step. The pool reuses a snapshot once
its version's `FrameLog` is gone (superseded and no reader left). The lifetime rules:
docs/weight_publication.md, "The path" (snapshot lifetime).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Iterable, Iterator

import numpy

from services.weight_transport.tensor_codec import RawTensor

log = logging.getLogger(__name__)


class Snapshot:
    """Host copies of one version's weights: a uint8 buffer per tensor name, rewritten in
    place by a later version when its size matches (the pages stay mapped)."""

    def __init__(self) -> None:
        self.buffers: dict[str, numpy.ndarray] = {}

    def fill(self, tensors: Iterable[RawTensor]) -> Iterator[RawTensor]:
        """Copy each tensor in as it comes (they may view live weights, or a gathered
        ZeRO-3 weight let go after its copy) and yield the copy, a view of its buffer."""
        for raw in tensors:
            source = numpy.frombuffer(raw.data, dtype=numpy.uint8)
            buffer = self.buffers.get(raw.name)
            if buffer is None or buffer.size != source.size:
                buffer = self.buffers[raw.name] = numpy.empty(source.size, dtype=numpy.uint8)
            numpy.copyto(buffer, source)
            yield RawTensor(raw.name, raw.dtype, raw.shape, memoryview(buffer))  # type: ignore[arg-type]


class SnapshotPool:
    """Snapshots nothing reads any more, handed out again; new ones when none is free."""

    def __init__(self) -> None:
        self._free: deque[Snapshot] = deque()
        self._lock = threading.Lock()
        self.allocated = 0  # snapshots ever made (the pool's size)

    def take(self) -> Snapshot:
        """A free snapshot (its buffers hold an old version: overwrite them), else a new one."""
        try:
            return self._free.pop()
        except IndexError:
            pass
        with self._lock:
            self.allocated += 1
            count = self.allocated
        log.info("weight snapshots: allocating snapshot %d (none free)", count)
        return Snapshot()

    def give_back(self, snapshot: Snapshot) -> None:
        """`snapshot` is unreadable now. Lock-free (a deque append): it runs as a finalizer,
        possibly inside garbage collection on any thread, even one inside `take`."""
        self._free.append(snapshot)

    @property
    def free(self) -> int:
        return len(self._free)
