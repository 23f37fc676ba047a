"""Dynamic sampling filters and admission control: small pure functions, checked by hand."""

from __future__ import annotations

import pytest

from services.buffer.filters import decide
from services.common.settings import SharedConfig
from services.common.types import Group, Sample
from services.controller.admission import (
    PipelineCounts,
    RateEstimator,
    backlog_allows,
    sit_out,
    staleness_allows,
    uniform_streak,
)


def make_group(correct: list[bool], version: int = 3, rewards: list[float] | None = None) -> Group:
    rewards = rewards or [1.0 if c else -1.0 for c in correct]
    samples = [
        Sample([1, 2], [-0.1, -0.2], "x", "stop", version, reward=r, correct=c)
        for c, r in zip(correct, rewards, strict=True)
    ]
    return Group("g", "p", "q", [5], "1", samples=samples)


def run(group: Group, **kw) -> str:
    """decide() as the buffer calls it: the hard bound resolved by the config unless given."""
    args = dict(group_size=4, current_version=3, max_staleness=0, metric="acc") | kw
    if "max_staleness_hard" not in args:
        shared = SharedConfig(max_staleness=args["max_staleness"])
        args["max_staleness_hard"] = shared.staleness_hard_bound
    return decide(group, **args).reason


@pytest.mark.parametrize(
    ("correct", "reason"),
    [
        ([True] * 4, "all_correct"),
        ([False] * 4, "all_wrong"),
        ([True, False, False, False], "kept"),
        ([True, True, True, False], "kept"),
    ],
)
def test_keep_iff_accuracy_strictly_between_0_and_1(correct: list[bool], reason: str) -> None:
    assert run(make_group(correct)) == reason


def test_reward_metric_keeps_groups_whose_rewards_vary() -> None:
    # All wrong, but the overlong penalty differs: informative under the reward metric.
    group = make_group([False] * 4, rewards=[-1.0, -1.0, -1.5, -1.0])
    assert run(group, metric="reward") == "kept"
    assert run(group, metric="acc") == "all_wrong"
    assert run(make_group([False] * 4), metric="reward") == "no_variance"


def test_staleness_bound() -> None:
    assert run(make_group([True, False, True, False], version=2)) == "stale"
    assert run(make_group([True, False, True, False], version=2), max_staleness=1) == "kept"


def test_malformed_groups_are_refused_first() -> None:
    assert run(make_group([True, False, True])) == "malformed"  # 3 of 4 samples
    bad = make_group([True, False, True, False])
    bad.samples[0].logprobs = [-0.1]
    assert run(bad) == "malformed"
    nan = make_group([True, False, True, False])
    nan.samples[1].reward = float("nan")
    assert run(nan) == "malformed"


def test_dynamic_sampling_off_forwards_uninformative_groups() -> None:
    assert run(make_group([True] * 4), dynamic_sampling=False) == "kept"


def test_rate_estimator_follows_recent_decisions() -> None:
    est = RateEstimator(window=10, prior=0.5)
    assert est.update(0, 0) == 0.5  # no decisions yet: the prior
    assert est.update(1, 4) == pytest.approx(0.5 + 0.5 * (0.2 - 0.5))  # 5 of a 10-window
    assert est.update(21, 4) == pytest.approx(1.0)  # 20 new, all kept: window full
    assert est.update(21, 4) == pytest.approx(1.0)  # nothing new: unchanged


def test_staleness_budget_is_k_plus_one_batches() -> None:
    # 16 queued informative + 32 undecided at rate 0.5 = 32 expected.
    counts = PipelineCounts(admitted=100, kept=40, filtered=28, trained=24, dropped=0)
    assert counts.queued_informative == 16 and counts.undecided == 32
    assert not staleness_allows(counts, 0.5, batch_groups=32, max_staleness=0)
    assert staleness_allows(counts, 0.5, batch_groups=32, max_staleness=1)
    assert staleness_allows(counts, 0.25, batch_groups=32, max_staleness=0)
    # Half the batch: 32 expected is two whole batches, so k = 1 is full and k = 2 is not.
    assert not staleness_allows(counts, 0.5, batch_groups=16, max_staleness=1)
    assert staleness_allows(counts, 0.5, batch_groups=16, max_staleness=2)


def test_backlog_limit() -> None:
    counts = PipelineCounts(admitted=10, kept=10, trained=2, dropped=1)
    assert backlog_allows(counts, 8) and not backlog_allows(counts, 7)


def test_uniform_streak() -> None:
    assert uniform_streak([0.5, 1.0, 1.0]) == ("easy", 2)
    assert uniform_streak([1.0, 0.0, 0.0, 0.0]) == ("hard", 3)  # a run of one kind only
    assert uniform_streak([1.0, 0.5]) == (None, 0)
    assert uniform_streak([]) == (None, 0)


def test_sit_out_doubles_with_the_streak_up_to_the_cap() -> None:
    assert sit_out([1.0], 2, 8) == (None, 0)  # not enough history
    assert sit_out([0.5, 1.0, 1.0], 2, 8) == ("easy", 1)
    assert sit_out([0.0] * 3, 2, 8) == ("hard", 2)
    assert sit_out([1.0] * 4, 2, 8) == ("easy", 4)
    assert sit_out([1.0] * 8, 2, 8) == ("easy", 8)  # capped
    assert sit_out([1.0, 1.0, 0.5], 2, 8) == (None, 0)  # informative last time
    assert sit_out([1.0] * 5, 0, 8) == (None, 0)  # off
