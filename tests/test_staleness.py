"""The one staleness rule (soft bound: trained as fresh; up to the hard bound: trained with
the correction; past it: dropped), its defaults, and the correction it switches on."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from test_buffer_filters import make_group, run

from learner.config import LearnerSettings, MaskedIS, NoCorrection, TokenTIS
from services.buffer.config import BufferSettings
from services.buffer.filters import decide
from services.common.ledger import Ledger
from services.common.settings import SharedConfig
from services.common.staleness import judge, staleness, too_stale
from services.tools.report import staleness_line


@pytest.mark.parametrize(
    ("lag", "verdict"),
    [(0, "fresh"), (1, "fresh"), (2, "stale_trained"), (4, "stale_trained"), (5, "too_stale")],
)
def test_judge_between_the_soft_and_the_hard_bound(lag: int, verdict: str) -> None:
    assert judge(lag, soft=1, hard=4) == verdict


def test_staleness_is_measured_from_the_oldest_token() -> None:
    group = make_group([True, False], version=7)
    group.samples[1].policy_version = 5
    assert staleness(group, 8) == 3
    assert not too_stale(group, 8, soft=1, hard=3)
    assert too_stale(group, 9, soft=1, hard=3)


def test_buffer_keeps_informative_groups_up_to_the_hard_bound() -> None:
    informative = [True, False, True, False]
    old = make_group(informative, version=1)  # 2 versions behind the buffer's 3
    assert run(old, max_staleness=1, max_staleness_hard=1) == "stale"  # hard = soft
    assert run(old, max_staleness=1, max_staleness_hard=2) == "kept"
    assert run(make_group(informative, version=0), max_staleness=1, max_staleness_hard=2) == (
        "stale"
    )


def test_the_buffer_takes_the_hard_bound_the_config_resolved() -> None:
    """No second default in the filters: decide() needs the bound, the config supplies it."""
    informative = [True, False, True, False]
    with pytest.raises(TypeError, match="max_staleness_hard"):
        decide(
            make_group(informative, version=1),
            group_size=4,
            current_version=3,
            max_staleness=1,
            metric="acc",
        )
    settings = BufferSettings.model_validate({"shared": {"max_staleness": 1}})
    assert settings.shared.max_staleness_hard == 4  # resolved in the model, visible as data
    for version, verdict in ((1, "kept"), (0, "stale")):  # 4 and 5 versions behind
        decision = decide(
            make_group(informative, version=version),
            group_size=4,
            current_version=5,
            max_staleness=settings.shared.max_staleness,
            max_staleness_hard=settings.shared.staleness_hard_bound,
            metric="acc",
        )
        assert decision.reason == verdict


def test_uninformative_stale_groups_are_counted_as_uninformative() -> None:
    """`stale` counts only informative groups lost: the drop rate is over what could train."""
    assert run(make_group([True] * 4, version=0), max_staleness=0) == "all_correct"


def test_hard_bound_defaults_to_four_times_the_soft_one_and_is_never_below_it() -> None:
    assert SharedConfig(max_staleness=0).staleness_hard_bound == 0
    assert SharedConfig(max_staleness=2).staleness_hard_bound == 8
    assert SharedConfig(max_staleness=2, max_staleness_hard=2).staleness_hard_bound == 2
    with pytest.raises(ValidationError, match="max_staleness_hard"):
        SharedConfig(max_staleness=2, max_staleness_hard=1)


def test_correction_is_on_by_default_exactly_when_stale_groups_can_be_trained() -> None:
    def settings(**shared: int | None) -> LearnerSettings:
        return LearnerSettings.model_validate({"shared": shared})

    assert settings(max_staleness=0).correction == NoCorrection()
    assert settings(max_staleness=1).correction == TokenTIS(cap=2.0)
    assert settings(max_staleness=0, max_staleness_hard=1).correction == TokenTIS(cap=2.0)
    chosen = LearnerSettings.model_validate(
        {
            "shared": {"max_staleness": 1},
            "learner": {"objective": {"correction": {"kind": "mis", "high": 3}}},
        }
    )
    assert chosen.correction == MaskedIS(level="token", low=0.5, high=3.0)
    off = LearnerSettings.model_validate(
        {"shared": {"max_staleness": 1}, "learner": {"objective": {"correction": {"kind": "none"}}}}
    )
    assert off.correction == NoCorrection()
    with pytest.raises(ValidationError):
        LearnerSettings.model_validate({"learner": {"objective": {"correction": {"kind": "tis"}}}})


def test_ledger_and_report_count_informative_groups_dropped_as_stale() -> None:
    ledger = Ledger(kept=96, filtered={"stale": 4, "all_correct": 50}, dropped={"stale": 1})
    assert ledger.stale_dropped == 5 and ledger.stale_drop_rate == 0.05
    report = {
        "ledger": ledger.as_dict(),
        "steps": [
            {"beyond_soft": 2, "policy_lag_max": 3, "engine_mismatch": 0.02, "mismatch_tokens": 9},
            {"beyond_soft": 1, "policy_lag_max": 1, "engine_mismatch": 0.5, "mismatch_tokens": 0},
        ],
    }
    assert staleness_line(report) == (
        "staleness: 5 informative groups dropped past the hard bound (5.00%), 3 trained past "
        "the soft bound; policy lag up to 3; engine mismatch 2.00e-02 (mean |Δ log-prob|)"
    )
