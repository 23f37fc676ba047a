"""When the engine's log-probs may stand in for the learner's recompute of π_old.

π_old in DAPO's ratio is the policy that sampled the responses. The learner recomputes
it because the engine's numbers may differ from its own (other kernels, dtype, a KV
cache); when every token was sampled by the very weights being trained and the gap was
measured below a bound, the recompute cannot change the ratio by more than that bound,
so `old_logprobs: auto` skips it. The gap is re-measured every `RECHECK_EVERY` steps.
Why this is exact enough: docs/architecture.md, "One step".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from learner.batch import TrainSequence
from learner.config import ObjectiveConfig

RECHECK_EVERY = 10  # steps a measured gap stays trusted
CLIP_SHARE = 0.1  # the bound must be below this share of min(ε_low, ε_high)
_GAP_UNIT = 1e-9  # gaps cross ranks as integers of this unit (all_reduce_max takes ints)


def same_version_gap(seqs: Sequence[TrainSequence], version: int) -> float | None:
    """Max |log π_engine − log π_old| over tokens sampled by `version` (None: no such token).

    Run after the recompute (`old_logprobs` set).
    """
    gaps = []
    for s in seqs:
        if s.rollout_logprobs is None or s.old_logprobs is None:
            continue
        same = s.versions() == version
        if same.any():
            diff = s.old_logprobs.double().numpy() - s.rollout_logprobs.astype(np.float64)
            gaps.append(float(np.abs(diff[same]).max()))
    return max(gaps) if gaps else None


def gap_to_int(gap: float | None) -> int:
    """`gap` rounded up to `_GAP_UNIT`s; -1 for no measurement (for an all-reduce max)."""
    return -1 if gap is None else math.ceil(gap / _GAP_UNIT)


def gap_from_int(units: int) -> float | None:
    return None if units < 0 else units * _GAP_UNIT


@dataclass
class OldLogprobGate:
    """The learner's memory of the engine/learner gap, across steps (one per trainer)."""

    max_gap: float
    enabled: bool = True
    gap: float | None = None  # the last measured gap
    steps_since: int = 0  # steps since it was measured

    @classmethod
    def from_config(cls, objective: ObjectiveConfig) -> OldLogprobGate:
        """Off unless `auto`, and unless the bound is well inside the clip range: a ratio
        off by e^gap must not cross a clip boundary that a ratio of exactly 1 would not."""
        clip = min(objective.clip_ratio_low, objective.clip_ratio_high)
        tight = objective.old_logprobs_max_gap < CLIP_SHARE * clip
        return cls(
            objective.old_logprobs_max_gap, enabled=objective.old_logprobs == "auto" and tight
        )

    def reuse(self, seqs: Sequence[TrainSequence], version: int, has_reference: bool) -> bool:
        """Whether this step may take the engine's log-probs as π_old (the same answer on
        every rank: `seqs` is the whole batch and the gap was all-reduced)."""
        return (
            self.enabled
            and not has_reference  # the reference's forward is needed anyway
            and self.gap is not None
            and self.gap <= self.max_gap
            and self.steps_since < RECHECK_EVERY
            and all(s.rollout_logprobs is not None for s in seqs)
            and all(bool((s.versions() == version).all()) for s in seqs)
        )

    def record(self, gap: float | None) -> None:
        """After a step: the gap it measured (None: it reused, or no token to measure)."""
        if gap is None:
            self.steps_since += 1
        else:
            self.gap, self.steps_since = gap, 0
