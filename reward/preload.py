"""Imported by the pool's forkserver (and by each worker) to pay math-verify's start-up once.

Importing math-verify takes ~0.7 s and its first parse/verify another ~0.2 s (parser
tables, sympy caches). Done here, in the forkserver, every worker forked from it,
including a replacement for a killed one, starts warm, so the first item a fresh worker
verifies is not charged that second against its timeout.
"""

from __future__ import annotations

import logging

_warm = False


def warm_up() -> None:
    """Import math-verify, run one small verification, and quiet its warning logs."""
    global _warm
    if _warm:
        return
    # It warns on every call made without its own timeout and on every timeout; the
    # service reports both in its results and metrics instead.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    from math_verify import parse, verify

    gold = parse("$\\frac{1}{2}$", parsing_timeout=None)
    verify(gold, parse("Answer: 0.5", parsing_timeout=None), timeout_seconds=None)
    _warm = True


warm_up()
