"""Memory for received tensors that is reused from version to version, by size.

Why: a rollout server receives a whole model per version into fresh buffers while it
still serves the previous one. Left to malloc, those buffers landed in memory the kernel
had to fault in and zero every other version (the heap could not grow in place, so
glibc mapped new regions; 50-65k page faults and 1-3 s of system time per 1.26 GB),
which cost more than receiving the bytes. Here each large buffer is an anonymous mmap
that goes back to a free list, still mapped, when the last view of it is gone (its
numpy array is collected: torch tensors, relay frames and memoryviews all hold it), and
the next version's tensor of the same size takes it back: the same model's tensors
reuse the same pages every version. Small buffers come from malloc as before.

Hold a buffer through its array, a memoryview of it or a tensor made from either
(`torch.frombuffer`), as every user here does: a numpy slice alone points past the array
to the mapping (numpy collapses view bases) and would not keep the memory from reuse.
Price: the pages of the peak (about two versions at a swap) stay mapped.
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
