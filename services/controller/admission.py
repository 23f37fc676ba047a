"""Admission control: how many prompts may be in the pipeline at once.

Three independent limits, each a small pure function of counters:

- *concurrency*: groups being generated or scored by this controller;
- *back-pressure*: informative groups queued for the learner (`train` backlog);
- *staleness*: with `max_staleness = k`, the learner will train at most (k + 1) batches
  before a group admitted now is too old; so the informative work expected from what is
  queued and in flight must stay below (k + 1) · N. `k = 0` is synchronous on-policy
  DAPO: only one batch worth of expected informative groups per policy version.

The expected informative yield of a group in flight uses a running estimate of the
informative rate (kept / decided), so admission adapts as the model gets better.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PipelineCounts:
    """A snapshot of the ledger, as admission sees it."""

    admitted: int = 0
    kept: int = 0
    filtered: int = 0
    trained: int = 0
    dropped: int = 0

    @property
    def undecided(self) -> int:
        """Groups admitted but not yet kept or filtered by the buffer."""
        return self.admitted - self.kept - self.filtered

    @property
    def queued_informative(self) -> int:
        """Kept groups the learner has not yet trained on or dropped."""
        return self.kept - self.trained - self.dropped


def informative_rate(kept: int, filtered: int, prior: float = 0.5, weight: int = 16) -> float:
    """Kept fraction with a prior worth `weight` groups (sane before any data arrives)."""
    return (kept + prior * weight) / (kept + filtered + weight)


def staleness_allows(
    counts: PipelineCounts, rate: float, batch_groups: int, max_staleness: int
) -> bool:
    """True while expected informative work < (max_staleness + 1) batches."""
    expected = counts.queued_informative + counts.undecided * rate
    return expected < (max_staleness + 1) * batch_groups


def backlog_allows(counts: PipelineCounts, max_backlog: int) -> bool:
    return counts.queued_informative < max_backlog


def difficulty_skip(history: list[float], window: int) -> str | None:
    """'easy' / 'hard' if the prompt's last `window` groups were all correct / all wrong."""
    recent = history[-window:]
    if window <= 0 or len(recent) < window:
        return None
    if all(r >= 1.0 for r in recent):
        return "easy"
    if all(r <= 0.0 for r in recent):
        return "hard"
    return None
