"""glibc malloc tuning for processes that receive weights (rollout servers; see process.py).

By default glibc serves large blocks (≥ 128 KiB, rising to at most 32 MiB) with mmap and
gives them back to the kernel on free, and trims the heap top: every weight bucket and
every received tensor then lands in fresh pages, which the kernel faults in and zeroes
one 4 KiB page at a time. Measured here, writing into fresh memory ran ~30× slower than
re-writing memory already mapped (docs/weight_publication.md). Raising the
mmap threshold (to 2 GiB: an embedding matrix of a 32B model fits) keeps blocks in the
heap, and the heap is never trimmed, so freed blocks serve the next version's buckets.
A fixed trim threshold is not enough: a rollout server holds two versions at a swap, and
when the older one is freed while the newer lies below it, the freed top of the heap is a
whole model, more than any threshold, and went back to the kernel every other version.
The price is that the process keeps its peak heap mapped.

One arena for every thread: a thread other than the main one allocates from an arena of
its own, made of 64 MiB heaps, so a larger block (an embedding matrix) is mmap'd fresh
and unmapped again on free whatever the thresholds, and each new thread (a relay's
reception, the learner's publisher) starts from cold memory. Measured: 1 GB of tensors
allocated and written in a new thread each version took 0.21-0.25 s, against 0.09-0.10
s with one arena (as in the main thread). The price is one lock for large allocations
across threads; small Python objects come from Python's own allocator.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8
KEEP_BYTES = (1 << 31) - 1  # blocks up to this size come from the heap (mallopt takes an int)
NEVER_TRIM = -1


def keep_freed_memory(threshold: int = KEEP_BYTES) -> bool:
    """Apply the thresholds; False (and nothing changed) where libc has no mallopt."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError, TypeError):
        log.info("no glibc mallopt here: malloc left at its defaults")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(
        mallopt(M_MMAP_THRESHOLD, threshold)
        and mallopt(M_TRIM_THRESHOLD, NEVER_TRIM)
        and mallopt(M_ARENA_MAX, 1)
    )
