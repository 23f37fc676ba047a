"""How stale a group may be, in one place: the buffer's filter and the learner's drop agree.

A group's staleness is the learner's current version minus the oldest version that
sampled any of its tokens. Up to the soft bound (`shared.max_staleness`, what admission
paces for) a group is fresh; up to the hard bound (`shared.max_staleness_hard`) it is
still trained, with the learner's off-policy correction; only past the hard bound is it
dropped. Dropping only the groups that took longest to generate would bias the batch
towards short responses, so the hard bound is set well above what pacing produces.
"""

from __future__ import annotations

from typing import Literal

from services.common.types import Group

Verdict = Literal["fresh", "stale_trained", "too_stale"]


def staleness(group: Group, current_version: int) -> int:
    """Versions between the oldest token of `group` and `current_version` (≥ 0 normally)."""
    return current_version - group.min_policy_version


def judge(lag: int, soft: int, hard: int) -> Verdict:
    """`fresh` up to `soft`, `stale_trained` up to `hard`, `too_stale` past it."""
    if lag > hard:
        return "too_stale"
    return "stale_trained" if lag > soft else "fresh"


def too_stale(group: Group, current_version: int, soft: int, hard: int) -> bool:
    """True iff `group` must be dropped (the one rule the buffer and the learner apply)."""
    return judge(staleness(group, current_version), soft, hard) == "too_stale"
