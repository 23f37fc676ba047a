"""Memory for received tensors that is reused from version to version, by size.

A rollout server receives a whole model per version while it still serves the previous
one; left to malloc, those buffers landed in fresh pages the kernel faulted in and zeroed
every other version, which cost more than receiving the bytes. Large buffers here are
anonymous mmaps that return to a free list, still mapped, once their last view is gone.
How to hold a buffer so it is not reused early, and the price: docs/weight_publication.md,
"The path" (the receiver never zero-fills).
"""

from __future__ import annotations

import mmap
import weakref
from collections import deque
from typing import Any

MIN_RECYCLED_BYTES = 1 << 20  # smaller buffers: malloc's (a mapping each would be waste)


class RecycledBuffers:
    """Uninitialized uint8 arrays; the large ones reuse the memory of collected ones."""

    def __init__(self, min_bytes: int = MIN_RECYCLED_BYTES) -> None:
        self.min_bytes = min_bytes
        self.mapped = 0  # bytes ever mapped (a test watches it stop growing)
        self._free: dict[int, deque[mmap.mmap]] = {}

    def take(self, nbytes: int) -> Any:
        """An array of `nbytes` whose contents are undefined (every byte gets written)."""
        import numpy

        if nbytes < self.min_bytes:
            return numpy.empty(nbytes, dtype=numpy.uint8)
        free = self._free.setdefault(nbytes, deque())
        try:
            region = free.pop()  # deque ops are atomic: a finalizer may run on any thread
        except IndexError:
            region = mmap.mmap(-1, nbytes)
            self.mapped += nbytes
        array = numpy.frombuffer(region, dtype=numpy.uint8)
        weakref.finalize(array, free.append, region)  # back once nothing views it
        return array

    def free_bytes(self) -> int:
        return sum(size * len(regions) for size, regions in self._free.items())


RECEIVED = RecycledBuffers()
"""The process's pool: every `WeightAssembler` takes its tensors' memory from it."""
