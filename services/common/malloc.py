"""glibc malloc tuning for processes that move weights (learner, rollout servers).

By default glibc serves large blocks (≥ 128 KiB, rising to at most 32 MiB) with mmap and
gives them back to the kernel on free, and trims the heap top: every weight bucket and
every received tensor then lands in fresh pages, which the kernel faults in and zeroes
one 4 KiB page at a time. Measured here, writing into fresh memory ran ~30× slower than
re-writing memory already mapped (docs/weight_publication.md). Raising the mmap and trim
thresholds keeps freed blocks in the heap for the next version's buckets; the price is
that the process keeps its peak heap mapped.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
KEEP_BYTES = 1 << 30  # blocks up to this size come from the heap, which is never trimmed


def keep_freed_memory(threshold: int = KEEP_BYTES) -> bool:
    """Apply the thresholds; False (and nothing changed) where libc has no mallopt."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError, TypeError):
        log.info("no glibc mallopt here: malloc left at its defaults")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, threshold) and mallopt(M_TRIM_THRESHOLD, threshold))
