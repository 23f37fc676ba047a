"""A run's identity and what `dapo up` decides from it, in-process: the config differences
a resume applies or refuses, `--fresh` moving a run aside, a checkpoint directory of
another run refused, the stall line's live cause and the summary's ratios in words."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from learner.checkpoints import check_owner
from services.common.errors import DapoError
from services.tools.config import DapoConfig, load_config
from services.tools.liveness import dominant_cause
from services.tools.report import sampling_line, sampling_summary
from services.tools.resume import applied_changes, begin
from services.tools.run_dir import RunRecord, move_aside, write_record

pytestmark = pytest.mark.unit


def tiny(*overrides: str) -> DapoConfig:
    return load_config(preset="tiny", overrides=list(overrides), env={})


def test_a_resume_applies_safe_changes_and_refuses_run_changing_ones() -> None:
    saved = tiny("shared.redis_url=redis://127.0.0.1:1/0", "learner.checkpoint.dir=/r/ck")
    assert applied_changes(saved, tiny()) == []  # where dapo up put its pieces: not a change
    lines = applied_changes(saved, tiny("learner.optimizer.lr=0.0002", "learner.total_steps=40"))
    assert lines == [
        "changed on resume: learner.optimizer.lr 0.0005 → 0.0002",
        "changed on resume: learner.total_steps 100 → 40",
    ]
    for change in ("shared.group_size=8", "learner.objective.clip_ratio_high=0.3"):
        with pytest.raises(DapoError, match="would make it another run.*--fresh"):
            applied_changes(saved, tiny(change, "learner.optimizer.lr=0.0002"))


def test_a_plain_start_refuses_a_run_directory_and_fresh_moves_it_aside(tmp_path: Path) -> None:
    run_dir = tmp_path / "R"
    run_dir.mkdir()
    record = RunRecord("abc", "tiny", [{"start_step": 0, "end_step": 15, "total_steps": 40}])
    write_record(run_dir, record)
    (run_dir / ".lock").write_text("1")
    with pytest.raises(DapoError) as refused:
        begin(tiny(), run_dir, "new")
    assert str(refused.value) == (
        f"{run_dir} holds run tiny (id abc, stopped at step 15 of 40): `dapo up --resume` "
        "continues it, `dapo up --fresh` moves it aside to R.old-<time> and starts a new run"
    )
    segment = begin(tiny(), run_dir, "fresh")
    (aside,) = tmp_path.glob("R.old-*")
    assert json.loads((aside / "run.json").read_text())["run_id"] == "abc"
    assert segment.run_id != "abc" and not segment.resumed
    assert sorted(p.name for p in run_dir.iterdir()) == [".lock"]  # the lock stays ours
    assert move_aside(run_dir).name.startswith("R.old-")  # a second aside never clobbers


def test_a_checkpoint_directory_of_another_run_is_refused(tmp_path: Path) -> None:
    check_owner(tmp_path, "mine")  # no checkpoint: nothing to refuse
    (tmp_path / "latest").write_text("step100")
    with pytest.raises(DapoError, match=r"of run \(unknown: no run_id\), not of this run mine"):
        check_owner(tmp_path, "mine")
    (tmp_path / "run_id").write_text("other")
    with pytest.raises(DapoError, match="checkpoints of run other, not of this run mine"):
        check_owner(tmp_path, "mine")
    (tmp_path / "run_id").write_text("mine")
    check_owner(tmp_path, "mine")


def test_the_stall_cause_is_the_outcome_of_the_last_window() -> None:
    ready = [{"accepting": True, "version": 0}]
    assert dominant_cause({"admitted": 48, "filtered all_wrong": 48}, 30, ready, 3) == (
        "every group (48) filtered all_wrong in the last 30s"
    )
    stale = dominant_cause({"dropped stale": 40, "kept": 5}, 30, ready, 6)
    assert stale == "40 of 45 groups dropped stale in the last 30s (policy v6, rollout " + (
        "servers at [0]: lag 6)"
    )
    waiting = [{"accepting": False, "version": 0}]
    assert dominant_cause({}, 30, waiting, 6).startswith("no rollout server ready (policy v6")
    assert dominant_cause({"admitted": 3}, 30, ready, 0) == (
        "no group decided in the last 30s (3 admitted)"
    )


def test_a_ratio_without_a_denominator_is_said_in_words() -> None:
    ledger = {"kept": 0, "filtered": {"all_wrong": 2955}}
    summary = sampling_summary([], ledger, 16, 4.0)
    assert summary["generated_per_trained"] is None
    assert sampling_line(summary) == "dynamic sampling: 2955 groups generated, none trained"
