"""glibc malloc tuning for processes that receive weights (rollout servers; see process.py).

glibc's defaults mmap large blocks fresh and trim the heap, so every received weight
bucket lands in pages the kernel faults in and zeroes. Here the mmap threshold is 2 GiB,
the heap is never trimmed and all threads share one arena, so the next version reuses the
memory the last one freed; the price is a peak heap that stays mapped. Why each setting
and what it measured: docs/weight_publication.md, "The path" (glibc keeps freed memory).
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
