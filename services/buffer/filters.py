"""Dynamic sampling as small pure filters (the paper's technique 2, equation 11).

Each filter looks at one group and returns a decision with a reason; the reason is the
metric label and the ledger counter. DAPO keeps a group iff 0 < accuracy < 1, i.e. the
chosen metric varies inside the group (otherwise every advantage is 0 and the group
contributes no gradient). Informativeness is decided before staleness, so `stale` counts
only informative groups lost to the hard staleness bound (`services/common/staleness.py`).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Literal

from services.common.staleness import too_stale
from services.common.types import Group

Reason = Literal["kept", "all_correct", "all_wrong", "no_variance", "stale", "malformed"]


@dataclass(frozen=True)
class FilterDecision:
    keep: bool
    reason: Reason


KEPT = FilterDecision(True, "kept")


def check_wellformed(group: Group, group_size: int) -> FilterDecision:
    """Refuse groups the learner could not train on."""
    if len(group.samples) != group_size:
        return FilterDecision(False, "malformed")
    for s in group.samples:
        if len(s.token_ids) != len(s.logprobs) or s.finish_reason == "abort":
            return FilterDecision(False, "malformed")
        if s.reward != s.reward:  # NaN
            return FilterDecision(False, "malformed")
    return KEPT


def check_fresh(group: Group, current_version: int, soft: int, hard: int) -> FilterDecision:
    """Drop a group past the hard staleness bound (past the soft one it is still trained)."""
    if too_stale(group, current_version, soft, hard):
        return FilterDecision(False, "stale")
    return KEPT


def check_informative(group: Group, metric: Literal["acc", "reward"]) -> FilterDecision:
    """DAPO's rule: keep iff the metric has std > 0 within the group."""
    if metric == "acc":
        correct = sum(s.correct for s in group.samples)
        if correct == len(group.samples):
            return FilterDecision(False, "all_correct")
        if correct == 0:
            return FilterDecision(False, "all_wrong")
        return KEPT
    if statistics.pstdev(s.reward for s in group.samples) > 0:
        return KEPT
    return FilterDecision(False, "no_variance")


def decide(
    group: Group,
    *,
    group_size: int,
    current_version: int,
    max_staleness: int,
    max_staleness_hard: int,
    metric: Literal["acc", "reward"],
    dynamic_sampling: bool = True,
) -> FilterDecision:
    """Apply the filters in order; the first refusal is the reason.

    `max_staleness_hard` is the resolved `shared.staleness_hard_bound`: its default lives in
    the config alone.
    """
    for decision in (
        check_wellformed(group, group_size),
        check_informative(group, metric) if dynamic_sampling else KEPT,
        check_fresh(group, current_version, max_staleness, max_staleness_hard),
    ):
        if not decision.keep:
            return decision
    return KEPT
