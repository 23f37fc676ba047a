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
        if self.fail is not None:
            raise self.fail
        return Generated([7, 8], [sample() for _ in range(n)])


@dataclass
class Rewards:
    fail: BaseException | None = None

    def score(
        self, request_id: str, samples: list[Sample], ground_truth: str, stop: threading.Event
    ) -> list[Sample]:
        if self.fail is not None:
            raise self.fail
        samples[0].correct = True
        return samples


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

    def publish(self, group: Group, timing: Timing) -> bool:
        self.published.append((group, timing))
        return True

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
    evaluator = Evaluator(host, [RECORD])  # type: ignore[arg-type]  # no Redis, no router
    scored = evaluator.sample(RECORD, 4, threading.Event())
    assert scored is not None and [s.correct for s in scored] == [True, False, False]
    assert host.rollouts.asked == [("eval-v4-p1", 3, 4)]
    host.rollouts.fail = Stopped("eval")
    assert evaluator.sample(RECORD, 4, threading.Event()) is None
