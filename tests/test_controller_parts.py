"""The controller's parts, each against fakes of our own protocols (no Redis, no gRPC):
Admission over injected sources, the Episode's outcomes, the clients' retry rules."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest

from services.common.data import PromptRecord
from services.common.error_log import ErrorLog
from services.common.server_config import RpcConfig
from services.common.settings import SamplingConfig
from services.common.types import Group, Sample
from services.controller.admission import (
    Admission,
    Limits,
    PipelineCounts,
    Snapshot,
    history_length,
    sit_out,
    staleness_allows,
    staleness_room,
)
from services.controller.clients import Retrier
from services.controller.config import ControllerSettings
from services.controller.episode import (
    Episode,
    EpisodeSettings,
    Generated,
    Outcome,
    Ticket,
    Timing,
)
from services.controller.evaluation import Evaluator
from services.controller.failures import (
    CONTROLLER_ERROR,
    GroupRejected,
    Rejection,
    RejectionStreak,
    Stopped,
)
from services.tools.config import load_config

RECORD = PromptRecord("p1", "3,1,2=", "3", "max3")
TICKET = Ticket("e0-0", "p1", 0, 5)


# -- Admission ---------------------------------------------------------------------------


@dataclass
class Pipeline:
    counts: PipelineCounts = field(default_factory=PipelineCounts)
    version: int = 0
    done: bool = False
    asked: int = 0

    def snapshot(self) -> Snapshot:
        self.asked += 1
        return Snapshot(self.counts, self.version, self.done)


@dataclass
class Rates:
    histories: dict[str, list[float]] = field(default_factory=dict)

    def history(self, prompt_id: str) -> Sequence[float]:
        return self.histories.get(prompt_id, [])


def limits(**kw: int) -> Limits:
    base = dict(
        max_in_flight=4,
        max_backlog=8,
        batch_groups=2,
        max_staleness=1,
        difficulty_window=2,
        max_skip_epochs=8,
    )
    return Limits(**(base | kw))


def test_admission_applies_each_limit_to_its_source() -> None:
    pipeline = Pipeline(version=7)
    admission = Admission(limits(), pipeline, Rates())
    verdict = admission.check(in_flight=0)
    assert (verdict.admit, verdict.version, verdict.done) == (True, 7, False)
    assert not admission.check(in_flight=4).admit  # concurrency
    pipeline.counts = PipelineCounts(admitted=8, kept=8)  # 8 queued: backlog full
    assert not admission.check(in_flight=0).admit
    pipeline.counts = PipelineCounts(admitted=8, kept=8, trained=6)  # 2 queued, 0 undecided
    assert admission.check(in_flight=0).admit
    pipeline.counts = PipelineCounts(admitted=16, kept=8, trained=6)  # 8 undecided: stale
    assert not admission.check(in_flight=0).admit
    pipeline.done = True
    assert admission.check(in_flight=0) == admission.check(in_flight=0)
    assert admission.check(in_flight=0).done and not admission.check(in_flight=0).admit


@pytest.mark.parametrize("rate", [0.0, 0.25, 0.3, 0.5, 1.0])
@pytest.mark.parametrize(("queued", "undecided"), [(0, 0), (1, 3), (3, 0), (4, 0), (0, 9)])
def test_the_room_is_what_admitting_one_at_a_time_would_allow(
    rate: float, queued: int, undecided: int
) -> None:
    """A burst admits exactly the groups that checks after each admission would."""
    counts = PipelineCounts(admitted=queued + undecided, kept=queued)
    one_by_one = 0
    while one_by_one < 50 and staleness_allows(counts, rate, 2, 1):
        one_by_one += 1
        counts = PipelineCounts(admitted=counts.admitted + 1, kept=queued)
    start = PipelineCounts(admitted=queued + undecided, kept=queued)
    assert staleness_room(start, rate, 2, 1, most=50) == one_by_one
    pipeline = Pipeline(counts=start)
    admission = Admission(limits(max_in_flight=6), pipeline, Rates())
    admission.estimator.rate = rate  # no decisions yet: update() keeps it
    verdict = admission.check(in_flight=1)
    assert verdict.room == min(one_by_one, 5) and verdict.admit == (verdict.room > 0)


def test_a_hard_prompt_sits_out_one_epoch_then_is_retried() -> None:
    rates = Rates({"p1": [0.0, 0.0]})
    admission = Admission(limits(), Pipeline(), rates)
    assert [admission.skip_reason("p1") for _ in range(3)] == ["hard", None, "hard"]
    rates.histories["p1"] = [0.5, 1.0]  # informative recently: never skipped
    assert [admission.skip_reason("p1") for _ in range(2)] == [None, None]
    assert admission.skip_reason("unseen") is None


def test_a_prompt_that_stays_easy_sits_out_longer_each_time() -> None:
    rates = Rates()
    admission = Admission(limits(), Pipeline(), rates)

    def visits(history: list[float], n: int) -> list[str | None]:
        rates.histories["p1"] = history
        return [admission.skip_reason("p1") for _ in range(n)]

    assert visits([1.0, 1.0], 2) == ["easy", None]  # one epoch out, then admitted
    assert visits([1.0, 1.0, 1.0], 3) == ["easy", "easy", None]  # easy again: two
    assert visits([1.0] * 8, 9) == ["easy"] * 8 + [None]  # at most max_skip_epochs
    assert visits([1.0] * 8 + [0.5], 1) == [None]


def test_difficulty_skipping_off_samples_every_prompt_as_the_paper() -> None:
    admission = Admission(limits(difficulty_window=0), Pipeline(), Rates({"p1": [1.0] * 4}))
    assert admission.skip_reason("p1") is None


@pytest.mark.parametrize(("window", "epochs"), [(1, 1), (2, 8), (3, 5), (2, 64)])
def test_the_kept_history_is_as_long_as_any_verdict_needs(window: int, epochs: int) -> None:
    keep = history_length(window, epochs)
    assert sit_out([1.0] * keep, window, epochs) == ("easy", epochs)  # the longest sit-out
    for length in range(keep, 3 * keep):  # a longer history changes no verdict
        assert sit_out([1.0] * length, window, epochs) == ("easy", epochs)


# -- Episode -----------------------------------------------------------------------------


def sample(correct: bool = False) -> Sample:
    return Sample([1, 2], [-0.1, -0.2], "3", "stop", 5, correct=correct)


@dataclass
class Rollouts:
    fail: BaseException | None = None
    asked: list[tuple[str, int, int]] = field(default_factory=list)
    bad: set[str] = field(default_factory=set)  # prompt ids refused
    batches: list[list[str]] = field(default_factory=list)  # generate_many's request ids

    def generate(
        self,
        request_id: str,
        record: PromptRecord,
        n: int,
        sampling: SamplingConfig,
        min_version: int,
        stop: threading.Event,
    ) -> Generated:
        self.asked.append((request_id, n, min_version))
        if self.fail is not None or record.prompt_id in self.bad:
            raise self.fail or GroupRejected(Rejection("prompt_too_long", record.prompt_id))
        return Generated([7, 8], [sample() for _ in range(n)])

    def generate_many(
        self,
        asks: Sequence[tuple[str, PromptRecord]],
        n: int,
        sampling: SamplingConfig,
        min_version: int,
        stop: threading.Event,
        priority: int = 0,
    ) -> list[Generated]:
        """As a rollout server: one refused group refuses the whole call."""
        self.batches.append([request_id for request_id, _ in asks])
        if any(record.prompt_id in self.bad for _, record in asks):
            raise GroupRejected(Rejection("prompt_too_long", "one of the batch"))
        return [self.generate(i, r, n, sampling, min_version, stop) for i, r in asks]


@dataclass
class Rewards:
    fail: BaseException | None = None
    bad: set[str] = field(default_factory=set)  # request ids whose scoring fails for good
    calls: int = 0

    def score(
        self, request_id: str, samples: list[Sample], ground_truth: str, stop: threading.Event
    ) -> list[Sample]:
        if self.fail is not None or request_id in self.bad:
            raise self.fail or GroupRejected(Rejection("reward_bad_response", request_id))
        samples[0].correct = True
        return samples

    def score_many(
        self, asks: Sequence[tuple[str, list[Sample], str]], stop: threading.Event
    ) -> list[list[Sample] | BaseException]:
        self.calls += 1
        out: list[list[Sample] | BaseException] = []
        for request_id, samples, truth in asks:
            try:
                out.append(self.score(request_id, samples, truth, stop))
            except GroupRejected as exc:
                out.append(exc)
        return out


@dataclass
class Store:
    published: list[tuple[Group, Timing]] = field(default_factory=list)
    rejected: list[tuple[str, str, Rejection]] = field(default_factory=list)
    generating_now: set[str] = field(default_factory=set)

    @contextmanager
    def generating(self, group_id: str) -> Iterator[None]:
        self.generating_now.add(group_id)
        try:
            yield
        finally:
            self.generating_now.discard(group_id)

    fail: BaseException | None = None
    batches: int = 0

    def publish(self, group: Group, timing: Timing) -> bool:
        return self.publish_many([(group, timing)])[0]

    def publish_many(self, items: Sequence[tuple[Group, Timing]]) -> list[bool]:
        if self.fail is not None:
            raise self.fail
        self.batches += 1
        self.published += items
        return [True] * len(items)

    def reject(self, group_id: str, prompt_id: str, rejection: Rejection) -> bool:
        self.rejected.append((group_id, prompt_id, rejection))
        return True


def episode(
    rollouts: Rollouts | None = None, rewards: Rewards | None = None
) -> tuple[Episode, Store, RejectionStreak]:
    store, streak = Store(), RejectionStreak(2)
    settings = EpisodeSettings("run", 4, SamplingConfig())
    return (
        Episode(settings, rollouts or Rollouts(), rewards or Rewards(), store, streak),
        store,
        streak,
    )


def test_an_episode_generates_scores_and_publishes_one_group() -> None:
    rollouts = Rollouts()
    ep, store, _ = episode(rollouts)
    group = ep.run(TICKET, RECORD, threading.Event())
    assert rollouts.asked == [("e0-0", 4, 5)]  # G samples, at least the admission version
    assert [g for g, _ in store.published] == [group]
    assert (group.group_id, group.prompt_id, group.admitted_version) == ("e0-0", "p1", 5)
    assert group.prompt_token_ids == [7, 8] and group.accuracy == 0.25
    assert store.published[0][1].generate_s >= 0 and not store.generating_now
    assert ep.play(TICKET, RECORD, threading.Event()) is Outcome.PUBLISHED


@pytest.mark.parametrize(
    ("rollouts", "rewards", "reason"),
    [
        (Rollouts(GroupRejected(Rejection("prompt_too_long", "20 > 12"))), None, "prompt_too_long"),
        (None, Rewards(KeyError("pred")), CONTROLLER_ERROR),  # a bug: rejected, not dropped
        (Rollouts(RuntimeError("boom")), None, CONTROLLER_ERROR),
    ],
)
def test_every_failure_of_an_episode_rejects_the_group_with_a_reason(
    rollouts: Rollouts | None, rewards: Rewards | None, reason: str
) -> None:
    ep, store, streak = episode(rollouts, rewards)
    assert ep.play(TICKET, RECORD, threading.Event()) is Outcome.REJECTED
    ((group_id, prompt_id, rejection),) = store.rejected
    assert (group_id, prompt_id, rejection.reason) == ("e0-0", "p1", reason)
    assert "\n" not in rejection.detail and rejection.detail
    assert not store.published and not store.generating_now
    ep.play(TICKET, RECORD, threading.Event())
    assert streak.verdict() is not None  # two in a row: the run would stop with the reason


def test_a_stopped_episode_leaves_its_group_in_flight() -> None:
    ep, store, streak = episode(Rollouts(Stopped("e0-0")))
    assert ep.play(TICKET, RECORD, threading.Event()) is Outcome.STOPPED
    assert not store.published and not store.rejected and streak.verdict() is None
    assert (
        ep.play_many([TICKET, TICKET2], [RECORD, RECORD2], threading.Event())
        == [Outcome.STOPPED] * 2
    )
    assert not store.published and not store.rejected


TICKET2 = Ticket("e0-1", "p2", 0, 6)
RECORD2 = PromptRecord("p2", "1,1,2=", "2", "max3")
TICKET3 = Ticket("e0-2", "p3", 0, 6)
RECORD3 = PromptRecord("p3", "4,1,2=", "4", "max3")
BATCH = ([TICKET, TICKET2, TICKET3], [RECORD, RECORD2, RECORD3])


def test_groups_admitted_together_share_one_generate_call_and_one_score_call() -> None:
    rollouts, rewards = Rollouts(), Rewards()
    ep, store, _ = episode(rollouts, rewards)
    assert ep.play_many(*BATCH, threading.Event()) == [Outcome.PUBLISHED] * 3
    assert rollouts.batches == [["e0-0", "e0-1", "e0-2"]] and rewards.calls == 1
    assert [a[2] for a in rollouts.asked] == [6, 6, 6]  # the newest admission version
    published = [g for g, _ in store.published]
    assert [(g.group_id, g.prompt_id) for g in published] == [
        ("e0-0", "p1"),
        ("e0-1", "p2"),
        ("e0-2", "p3"),
    ]
    assert [g.admitted_version for g in published] == [5, 6, 6]  # each its own
    assert not store.generating_now and not store.rejected
    assert store.batches == 1  # one round trip publishes the three


def test_a_failed_batch_publish_rejects_each_group_as_a_lone_publish_would() -> None:
    ep, store, _ = episode()
    store.fail = ConnectionError("redis gone")
    outcomes = ep.play_many(*BATCH, threading.Event())
    assert outcomes == [Outcome.REJECTED] * 3 and not store.published
    assert {r[2].reason for r in store.rejected} == {CONTROLLER_ERROR}


def test_a_refused_batch_is_played_group_by_group_so_the_bad_group_fails_alone() -> None:
    rollouts = Rollouts(bad={"p2"})
    ep, store, _ = episode(rollouts)
    outcomes = ep.play_many(*BATCH, threading.Event())
    assert outcomes == [Outcome.PUBLISHED, Outcome.REJECTED, Outcome.PUBLISHED]
    assert [r[:2] for r in store.rejected] == [("e0-1", "p2")]
    assert store.rejected[0][2].reason == "prompt_too_long"
    assert sorted(g.group_id for g, _ in store.published) == ["e0-0", "e0-2"]


def test_a_group_whose_scoring_fails_in_a_batch_fails_alone() -> None:
    rollouts, rewards = Rollouts(), Rewards(bad={"e0-2"})
    ep, store, _ = episode(rollouts, rewards)
    outcomes = ep.play_many(*BATCH, threading.Event())
    assert outcomes == [Outcome.PUBLISHED, Outcome.PUBLISHED, Outcome.REJECTED]
    assert len(rollouts.batches) == 1  # generated once, not again per group
    assert [(r[0], r[2].reason) for r in store.rejected] == [("e0-2", "reward_bad_response")]


# -- the clients' retry rules and the eval curve's use of them ---------------------------


def retrier() -> Retrier:
    return Retrier(RpcConfig(backoff_base_s=0.001, backoff_cap_s=0.002), ErrorLog())


def test_transient_failures_are_retried_permanent_ones_reject_at_once() -> None:
    attempts: list[int] = []

    def flaky() -> str:
        attempts.append(1)
        if len(attempts) < 3:
            raise ConnectionError("no ready rollout server")
        return "ok"

    assert retrier().run(flaky, "rollout", "g", threading.Event()) == "ok"
    assert len(attempts) == 3

    def bad() -> str:
        attempts.append(1)
        raise ValueError("expected 16 samples, got 3")

    attempts.clear()
    with pytest.raises(GroupRejected) as rejected:
        retrier().run(bad, "rollout", "g", threading.Event())
    assert rejected.value.rejection.reason == "rollout_bad_response" and len(attempts) == 1


def test_stopping_ends_the_retries_with_stopped() -> None:
    stop = threading.Event()

    def down() -> str:
        stop.set()
        raise ConnectionError("no reward service registered")

    with pytest.raises(Stopped):
        retrier().run(down, "reward", "g", stop)


@dataclass
class Host:
    """What an Evaluator uses of the controller: config and the two typed clients."""

    rollouts: Rollouts
    rewards: Rewards
    config: ControllerSettings
    client: None = None  # read only by Evaluator.run and .record, not exercised here
    keys: None = None


def test_the_eval_curve_samples_through_the_same_clients() -> None:
    config = load_config(preset="tiny", env={}, overrides=["controller.eval.n=3"])
    host = Host(Rollouts(), Rewards(), config)
    evaluator = Evaluator(host, [RECORD, RECORD2])  # type: ignore[arg-type]  # no Redis
    scored = evaluator.sample([RECORD, RECORD2], 4, threading.Event())
    assert (
        scored is not None
        and [[s.correct for s in row] for row in scored] == [[True, False, False]] * 2
    )
    assert host.rollouts.asked == [("eval-v4-p1", 3, 4), ("eval-v4-p2", 3, 4)]
    assert host.rollouts.batches == [["eval-v4-p1", "eval-v4-p2"]]  # one call
    host.rollouts.fail = Stopped("eval")
    assert evaluator.sample([RECORD], 4, threading.Event()) is None
