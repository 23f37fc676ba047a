"""Admission control: how many prompts may be in the pipeline at once, and which.

Three independent limits, each a small pure function of counters: concurrency (groups
being generated or scored), back-pressure (informative groups queued for the learner)
and staleness (the informative work expected from what is queued and in flight stays
below (max_staleness + 1) · N, with a running estimate of the informative rate); then
difficulty skipping. `Admission` combines them over injected sources (as AReaL's
staleness manager): no Redis here. Why that bound: docs/architecture.md.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from services.common.ledger import prefixed


@dataclass(frozen=True)
class PipelineCounts:
    """A snapshot of the ledger, as admission sees it."""

    admitted: int = 0
    kept: int = 0
    filtered: int = 0
    trained: int = 0
    dropped: int = 0
    rejected: int = 0

    @property
    def undecided(self) -> int:
        """Groups admitted but not yet kept or filtered by the buffer (nor rejected: a
        rejected group is over, and waiting for it would stop admission for good)."""
        return self.admitted - self.kept - self.filtered - self.rejected

    @property
    def queued_informative(self) -> int:
        """Kept groups the learner has not yet trained on or dropped."""
        return self.kept - self.trained - self.dropped


def pipeline_counts(raw: dict[bytes, bytes]) -> PipelineCounts:
    """The counts admission needs, from the raw ledger hash."""
    ledger = {k.decode(): int(v) for k, v in raw.items()}
    return PipelineCounts(
        admitted=ledger.get("admitted", 0),
        kept=ledger.get("kept", 0),
        filtered=sum(prefixed(ledger, "filtered:").values()),
        # With checkpoints the learner acks (and counts `trained`) only at a checkpoint;
        # `stepped` counts groups as soon as their step commits, so pacing never stalls.
        trained=max(ledger.get("trained", 0), ledger.get("stepped", 0)),
        dropped=sum(prefixed(ledger, "dropped:").values()),
        rejected=sum(prefixed(ledger, "rejected:").values()),
    )


class RateEstimator:
    """Informative rate over roughly the last `window` decided groups (it drifts as the
    policy improves, so a run-long average would over-admit late in training)."""

    def __init__(self, window: int = 64, prior: float = 0.5) -> None:
        self.window, self.rate = window, prior
        self._kept = self._filtered = 0

    def update(self, kept: int, filtered: int) -> float:
        """Fold in the decisions made since the last call (counters are cumulative)."""
        dk, df = kept - self._kept, filtered - self._filtered
        self._kept, self._filtered = kept, filtered
        if dk + df > 0:
            weight = min(1.0, (dk + df) / self.window)
            self.rate += weight * (dk / (dk + df) - self.rate)
        return self.rate


def staleness_allows(
    counts: PipelineCounts, rate: float, batch_groups: int, max_staleness: int
) -> bool:
    """True while expected informative work < (max_staleness + 1) batches.

    A group admitted now lands behind the expected informative work already queued, so it
    is trained floor(expected / N) versions from now: that is its staleness.
    """
    expected = counts.queued_informative + counts.undecided * rate
    return expected < (max_staleness + 1) * batch_groups


def staleness_room(
    counts: PipelineCounts, rate: float, batch_groups: int, max_staleness: int, most: int = 1 << 20
) -> int:
    """How many groups staleness_allows admits one after another, each adding `rate` to
    the expected work (at most `most`): the j-th (from 0) while expected + j·rate < bound."""
    bound = (max_staleness + 1) * batch_groups

    def allows(j: int) -> bool:  # the very sum staleness_allows would compare
        return counts.queued_informative + (counts.undecided + j) * rate < bound

    if not allows(0):
        return 0
    if rate <= 0:
        return most
    room = min(most, math.ceil((bound - counts.queued_informative) / rate - counts.undecided))
    while room > 0 and not allows(room - 1):  # float rounding: settle on the exact count
        room -= 1
    while room < most and allows(room):
        room += 1
    return room


def backlog_allows(counts: PipelineCounts, max_backlog: int) -> bool:
    return counts.queued_informative < max_backlog


def uniform_streak(history: list[float]) -> tuple[str | None, int]:
    """The trailing run of all-correct ('easy') or all-wrong ('hard') groups: (kind, length)."""
    kind = None
    length = 0
    for rate in reversed(history):
        this = "easy" if rate >= 1.0 else "hard" if rate <= 0.0 else None
        if this is None or (kind is not None and this != kind):
            break
        kind, length = this, length + 1
    return kind, length


def sit_out(history: list[float], window: int, max_epochs: int) -> tuple[str | None, int]:
    """Difficulty-aware admission: (reason, epochs the prompt sits out before it is tried).

    A prompt whose last `window` groups were all correct (or all wrong) sits out one
    epoch; each further uniform group doubles that, up to `max_epochs`. A prompt whose
    groups keep coming back uniform is admitted less and less often (an easy tail costs
    generation and trains nothing), yet always again: the policy changes, and a prompt
    skipped forever would, once every prompt is, stall the run. window 0: off.
    """
    kind, length = uniform_streak(history)
    if window <= 0 or kind is None or length < window:
        return None, 0
    return kind, min(2 ** (length - window), max_epochs)


def history_length(window: int, max_epochs: int) -> int:
    """Pass rates per prompt that `sit_out` can use: the window, plus the streak that
    doubles the sit-out up to `max_epochs` (a longer history changes no verdict)."""
    return max(1, window + (max_epochs - 1).bit_length())


@dataclass(frozen=True)
class Snapshot:
    """The run as admission sees it: ledger counts, policy version, whether it is done."""

    counts: PipelineCounts
    version: int
    done: bool


@dataclass(frozen=True)
class Limits:
    """The admission settings (controller and shared config)."""

    max_in_flight: int
    max_backlog: int
    batch_groups: int
    max_staleness: int
    difficulty_window: int
    max_skip_epochs: int


class PipelineSource(Protocol):
    """Where the ledger counts, version and done flag come from (Redis, or a test's fake)."""

    def snapshot(self) -> Snapshot: ...


class PassRateSource(Protocol):
    """A prompt's recent pass rates, oldest first."""

    def history(self, prompt_id: str) -> Sequence[float]: ...


@dataclass(frozen=True)
class Verdict:
    """Whether one more group may be admitted now (and how many in a row), at which
    version; `done`: stop."""

    version: int
    done: bool
    room: int  # groups that may be admitted one after another now

    @property
    def admit(self) -> bool:
        return self.room > 0


class Admission:
    """The concurrency, back-pressure, staleness and difficulty limits over injected
    sources. Not thread-safe: one admission loop asks it."""

    def __init__(self, limits: Limits, pipeline: PipelineSource, rates: PassRateSource) -> None:
        self.limits, self.pipeline, self.rates = limits, pipeline, rates
        self.estimator = RateEstimator()
        self._skips: Counter[str] = Counter()

    @property
    def informative_rate(self) -> float:
        return self.estimator.rate

    def check(self, in_flight: int) -> Verdict:
        """Whether a group may start now (given `in_flight` groups running here).

        No rollout lag enters the staleness limit: every group asks its rollout server
        for at least the version current at admission (GenerateRequest.min_version).
        """
        snap = self.pipeline.snapshot()
        lim = self.limits
        rate = self.estimator.update(snap.counts.kept, snap.counts.filtered)
        room = 0
        if backlog_allows(snap.counts, lim.max_backlog) and not snap.done:
            concurrency = max(0, lim.max_in_flight - in_flight)
            room = staleness_room(
                snap.counts, rate, lim.batch_groups, lim.max_staleness, most=concurrency
            )
        return Verdict(snap.version, snap.done, room)

    def skip_reason(self, prompt_id: str) -> str | None:
        """Difficulty-aware admission: 'easy'/'hard' prompts sit out epochs (sit_out).

        A prompt is admitted again after the epochs its streak of uniform groups earns
        (1, doubling per further uniform group, at most `max_skip_epochs`).
        """
        window = self.limits.difficulty_window
        if window == 0:
            return None
        history = list(self.rates.history(prompt_id))
        reason, epochs = sit_out(history, window, self.limits.max_skip_epochs)
        if reason is None or self._skips[prompt_id] >= epochs:
            self._skips[prompt_id] = 0
            return None
        self._skips[prompt_id] += 1
        return reason
