"""Which items are verified in the request's own thread instead of the worker pool.

The pool exists for math-verify: its parses can hang or hold the GIL, so each runs in a
killable process. The `dapo` and `first_integer` rules are a few regexes over a bounded
window of short text: microseconds that cannot hang, while the trip to a worker (encode,
pipe, wake-up, decode, a Future) costs several times more than the check. On the tiny
preset that trip was most of the reward service's CPU. docs/reward.md, "Inline rules".
"""

from __future__ import annotations

import time

from reward.jobs import Outcome, Task
from reward.verifiers import run_verifier

INLINE_VERIFIERS = frozenset({"dapo", "first_integer"})
# Bounds that keep the rules' worst cases (a quadratic regex over the ground truth, a
# linear scan of the response) well under a millisecond-scale cost per item.
MAX_INLINE_GROUND_TRUTH_CHARS = 512
MAX_INLINE_RESPONSE_CHARS = 65_536


def runs_inline(task: Task) -> bool:
    """A bounded rule on short text: checked where it arrives, not in the pool."""
    return (
        task.verifier in INLINE_VERIFIERS
        and len(task.ground_truth) <= MAX_INLINE_GROUND_TRUTH_CHARS
        and len(task.response) <= MAX_INLINE_RESPONSE_CHARS
    )


def verify_inline(task: Task) -> Outcome:
    """The verdict a worker would give (the same `run_verifier`), with its seconds."""
    start = time.perf_counter()
    verdict = run_verifier(task.verifier, task.response, task.ground_truth)
    return Outcome(verdict, time.perf_counter() - start)
