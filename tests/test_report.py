"""The run report's time accounting (where each trained group's seconds went) and dynamic
sampling's cost (generated per trained, short steps), in the report and on the bar."""

from __future__ import annotations

import pytest

from services.tools.launcher import sampling_postfix
from services.tools.report import sampling_line, sampling_summary, summary_lines, time_accounting


def test_time_accounting_splits_a_groups_time() -> None:
    groups = [  # admitted → scored: 10 s, of which 7 generating and 1 scoring
        {
            "group_id": "a",
            "admitted_at": 100.0,
            "scored_at": 110.0,
            "generate_s": 7.0,
            "score_s": 1.0,
        },
        {
            "group_id": "b",
            "admitted_at": 104.0,
            "scored_at": 112.0,
            "generate_s": 6.0,
            "score_s": 0.5,
        },
        {"group_id": "c", "admitted_at": 0.0, "scored_at": 1.0},  # no timing: not counted
    ]
    traces = [{"step": 0, "groups": ["a", "b"]}, {"step": 9, "groups": ["a"]}]  # 9: no metrics
    steps = [{"step": 0, "seconds": 4.0, "committed_at": 120.0}]  # started at 116
    acc = time_accounting(groups, traces, steps)
    assert acc["groups"] == 2
    assert acc["mean_s"] == pytest.approx(
        {
            "generate": 6.5,
            "score": 0.75,
            "controller": (2.0 + 1.5) / 2,
            "wait": (6.0 + 4.0) / 2,
            "train": 2.0,
            "overhead": (3.0 + 2.0) / 2,
        }
    )
    assert acc["overhead_max_s"] == 3.0
    assert time_accounting([], traces, steps) == {"groups": 0}
    ledger = {"ok": True, "admitted": 2, "trained": 2, "filtered": {}, "dropped": {}}
    report = {
        "run": "r",
        "steps": steps,
        "wall_seconds": 30,
        "time_accounting": acc,
        "ledger": ledger,
    }
    line = summary_lines(report)[-1]
    assert "generate 6.500, train 2.000, overhead 2.500" in line and "batch 5.000" in line


def test_summary_counts_training_steps_not_metric_entries() -> None:
    """A learner restarted from its step-4 checkpoint trains steps 5 and 6 again: the
    metrics stream holds 8 entries for 6 steps."""
    steps = [{"step": s, "seconds": 1.0} for s in (1, 2, 3, 4, 5, 6, 5, 6)]
    ledger = {"ok": True, "admitted": 2, "trained": 2, "filtered": {}, "dropped": {}}
    report = {"run": "r", "steps": steps, "wall_seconds": 30, "ledger": ledger}
    first = summary_lines(report)[0]
    assert first.startswith("run r: 6 steps (2 trained again after a learner restart) in 30s")
    report["steps"] = steps[:6]
    assert summary_lines(report)[0].startswith("run r: 6 steps in 30s")


def test_dynamic_sampling_counts_short_steps_and_generated_per_trained() -> None:
    steps = [
        {"step": 1, "groups": 16, "generated": 20},
        {"step": 2, "groups": 4, "generated": 64},
        {"step": 3, "groups": 16, "generated": 40},
    ]
    ledger = {"kept": 40, "filtered": {"acc": 80, "stale": 4}}
    summary = sampling_summary(steps, ledger, 16, 4.0)
    assert summary["short_steps"] == 1 and summary["generated_per_trained"] == round(124 / 36, 2)
    assert "1 steps trained short batches after 4 × 16 groups" in sampling_line(summary)
    paper = sampling_summary(steps[:1], ledger, 16, None)
    assert "no generation budget" in sampling_line(paper)
    # The bar: generated per trained over the recent steps (newest first), the short batch.
    newest_first = steps[::-1]
    assert sampling_postfix(newest_first, 16) == {"gen/tr": "3.4"}
    assert sampling_postfix(newest_first[1:], 16) == {"gen/tr": "4.2", "batch": "4/16"}
    assert sampling_postfix([{"step": 1}], 16) == {}  # a learner that records neither
