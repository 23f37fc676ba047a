"""One group's life after admission: generate → score → publish, or a stated rejection.

`Episode.run` is the happy path and returns the published Group; `Episode.play` is what
the loop calls: every way a group can end is an Outcome, and any exception other than
stopping rejects the group with a reason (a metric label, `rejected:<reason>` in the
ledger, an entry in the `rejected` stream), so no group is left in `inflight` by a bug.
The collaborators are our own protocols (clients.py and run_state.py implement them).
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass
from typing import Protocol

from services.common.data import PromptRecord
from services.common.settings import SamplingConfig
from services.common.types import Group, Sample
from services.controller.failures import (
    GroupRejected,
    Rejection,
    RejectionStreak,
    Stopped,
    unexpected,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Ticket:
    """An admitted group, as recorded in `inflight`: what a restart re-runs."""

    group_id: str
    prompt_id: str
    epoch: int
    version: int  # the policy version at admission: the least its samples may come from


@dataclass(frozen=True)
class Generated:
    """A rollout server's answer: the prompt as it tokenized it, and the samples."""

    prompt_token_ids: list[int]
    samples: list[Sample]


@dataclass(frozen=True)
class Timing:
    """Seconds in the GenerateGroup and Score calls (for the run report)."""

    generate_s: float
    score_s: float


class Generator(Protocol):
    def generate(
        self,
        request_id: str,
        record: PromptRecord,
        n: int,
        sampling: SamplingConfig,
        min_version: int,
        stop: threading.Event,
    ) -> Generated: ...

    def generate_many(
        self,
        asks: Sequence[tuple[str, PromptRecord]],
        n: int,
        sampling: SamplingConfig,
        min_version: int,
        stop: threading.Event,
        priority: int = 0,
    ) -> list[Generated]: ...


class Scorer(Protocol):
    def score(
        self, request_id: str, samples: list[Sample], ground_truth: str, stop: threading.Event
    ) -> list[Sample]: ...

    def score_many(
        self, asks: Sequence[tuple[str, list[Sample], str]], stop: threading.Event
    ) -> list[list[Sample] | BaseException]: ...


class GroupStore(Protocol):
    """Where a group's end is written (once per group id) and its wait is shown."""

    def generating(self, group_id: str) -> AbstractContextManager[None]: ...

    def publish(self, group: Group, timing: Timing) -> bool: ...

    def publish_many(self, items: Sequence[tuple[Group, Timing]]) -> list[bool]: ...

    def reject(self, group_id: str, prompt_id: str, rejection: Rejection) -> bool: ...


class Outcome(enum.Enum):
    PUBLISHED = "published"
    REJECTED = "rejected"
    STOPPED = "stopped"  # the group stays in flight for the next controller


@dataclass(frozen=True)
class EpisodeSettings:
    run_id: str
    group_size: int
    sampling: SamplingConfig


class Episode:
    """Generates, scores and publishes admitted groups (thread-safe: one call per group)."""

    def __init__(
        self,
        settings: EpisodeSettings,
        generator: Generator,
        scorer: Scorer,
        store: GroupStore,
        streak: RejectionStreak,
        on_rejected: Callable[[Rejection], None] = lambda _: None,
    ) -> None:
        self.settings, self.generator, self.scorer, self.store = settings, generator, scorer, store
        self.streak, self.on_rejected = streak, on_rejected

    def run(self, ticket: Ticket, record: PromptRecord, stop: threading.Event) -> Group:
        """The group, published; raises Stopped, GroupRejected or whatever failed."""
        started, wall = time.monotonic(), time.time()
        with self.store.generating(ticket.group_id):
            generated = self.generator.generate(
                ticket.group_id,
                record,
                self.settings.group_size,
                self.settings.sampling,
                ticket.version,
                stop,
            )
        generate_s = time.monotonic() - started
        samples = self.scorer.score(ticket.group_id, generated.samples, record.ground_truth, stop)
        timing = Timing(generate_s, time.monotonic() - started - generate_s)
        group = self.group(ticket, record, generated.prompt_token_ids, samples, wall)
        self.store.publish(group, timing)
        return group

    def play_many(
        self, tickets: Sequence[Ticket], records: Sequence[PromptRecord], stop: threading.Event
    ) -> list[Outcome]:
        """play() for groups admitted together, with one GenerateGroups call and shared
        Score calls. A refused batch is played again group by group, and a group whose
        scoring failed fails alone, so one bad group never takes the others down."""
        if len(tickets) == 1:
            return [self.play(tickets[0], records[0], stop)]
        started, wall = time.monotonic(), time.time()
        try:
            with ExitStack() as waiting:
                for ticket in tickets:
                    waiting.enter_context(self.store.generating(ticket.group_id))
                generated = self.generator.generate_many(
                    [(t.group_id, r) for t, r in zip(tickets, records, strict=True)],
                    self.settings.group_size,
                    self.settings.sampling,
                    max(t.version for t in tickets),
                    stop,
                )
            generate_s = time.monotonic() - started
            scored = self.scorer.score_many(
                [
                    (t.group_id, g.samples, r.ground_truth)
                    for t, r, g in zip(tickets, records, generated, strict=True)
                ],
                stop,
            )
        except Stopped:
            return [Outcome.STOPPED] * len(tickets)
        except Exception as exc:  # a refused batch: each group on its own, so it fails alone
            log.info("a batch of %d groups failed (%s); playing them one by one", len(tickets), exc)
            return [self.play(t, r, stop) for t, r in zip(tickets, records, strict=True)]
        timing = Timing(generate_s, time.monotonic() - started - generate_s)
        built = [
            self.built(t, r, g, s, wall)
            for t, r, g, s in zip(tickets, records, generated, scored, strict=True)
        ]
        ready = [(t, b) for t, b in zip(tickets, built, strict=True) if isinstance(b, Group)]
        try:
            self.store.publish_many([(group, timing) for _, group in ready])
        except Exception as exc:  # as when a lone group's publish fails
            failed = {t.group_id: self.failed(t, exc) for t, _ in ready}
            return [b if isinstance(b, Outcome) else failed[b.group_id] for b in built]
        for _ in ready:
            self.streak.success()
        return [b if isinstance(b, Outcome) else Outcome.PUBLISHED for b in built]

    def built(
        self,
        ticket: Ticket,
        record: PromptRecord,
        generated: Generated,
        scored: list[Sample] | BaseException,
        admitted_at: float,
    ) -> Group | Outcome:
        """A group of a batch, ready to publish, or the outcome of why it is not."""
        if isinstance(scored, BaseException):
            return self.failed(ticket, scored)
        try:
            return self.group(ticket, record, generated.prompt_token_ids, scored, admitted_at)
        except Exception as exc:
            return self.failed(ticket, exc)

    def group(
        self,
        ticket: Ticket,
        record: PromptRecord,
        prompt_ids: list[int],
        samples: list[Sample],
        admitted_at: float,
    ) -> Group:
        if len(samples) != self.settings.group_size:
            raise ValueError(f"{len(samples)} samples for a group of {self.settings.group_size}")
        return Group(
            group_id=ticket.group_id,
            prompt_id=record.prompt_id,
            prompt=record.prompt,
            prompt_token_ids=prompt_ids,
            ground_truth=record.ground_truth,
            samples=samples,
            run_id=self.settings.run_id,
            epoch=ticket.epoch,
            admitted_version=ticket.version,
            admitted_at=admitted_at,
            scored_at=time.time(),
            data_source=record.data_source,
        )

    def play(self, ticket: Ticket, record: PromptRecord, stop: threading.Event) -> Outcome:
        """run(), with every failure turned into a rejection (or, when stopping, a group
        left in flight on purpose)."""
        return self.settle(ticket, lambda: self.run(ticket, record, stop))

    def settle(self, ticket: Ticket, work: Callable[[], object]) -> Outcome:
        """work()'s outcome for the group: published, rejected (why), or stopped."""
        try:
            work()
        except Exception as exc:
            return self.failed(ticket, exc)
        self.streak.success()
        return Outcome.PUBLISHED

    def failed(self, ticket: Ticket, exc: BaseException) -> Outcome:
        """The outcome of a group whose work raised `exc`: stopped (left in flight), or
        rejected with the reason (an unclassified exception: a bug, logged)."""
        if isinstance(exc, Stopped):
            return Outcome.STOPPED
        if isinstance(exc, GroupRejected):
            return self.reject(ticket, exc.rejection)
        log.error("group %s failed unexpectedly; rejecting it", ticket.group_id, exc_info=exc)
        return self.reject(ticket, unexpected(exc))

    def reject(self, ticket: Ticket, rejection: Rejection) -> Outcome:
        self.store.reject(ticket.group_id, ticket.prompt_id, rejection)
        self.streak.rejected(rejection)
        self.on_rejected(rejection)
        log.warning(
            "group %s (prompt %s) rejected: %s: %s",
            ticket.group_id,
            ticket.prompt_id,
            rejection.reason,
            rejection.detail,
        )
        return Outcome.REJECTED
