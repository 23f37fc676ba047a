"""A run directory under `dapo up`: one run at a time, Ctrl-C leaves a report that matches
the learner's last checkpoint, and the finished run can still be read (`dapo ledger --run`
starts its Redis again from the directory; `dapo eval --run` takes the run's settings)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
from pathlib import Path

import pytest
from dapo_cli import dapo, popen_as_typed
from run_audit import children_of, wait_for

from services.tools.cli import up_argv

pytestmark = pytest.mark.slow


def logged_steps(learner_log: Path) -> list[int]:
    return [int(m) for m in re.findall(r"step=(\d+) loss=", learner_log.read_text())]


def test_run_directory_is_locked_reported_after_stop_and_readable_after_the_run(
    tmp_path: Path, tiny_model: Path, killed_tree_env: dict[str, str]
) -> None:
    run_dir = tmp_path / "run"
    up = [
        *up_argv(run_dir, tiny_model),
        "--steps",
        "500",
        "--set",
        "controller.eval.enabled=false",
        "--set",
        "learner.checkpoint.every=1000",  # only the checkpoint on stop
    ]
    proc = popen_as_typed(
        up, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=killed_tree_env
    )
    learner_log = run_dir / "logs" / "learner.log"
    try:
        wait_for(
            lambda: learner_log.exists() and len(logged_steps(learner_log)) >= 3, 180, "step 3"
        )
        second = subprocess.run(up, capture_output=True, text=True, timeout=60)
        lines = second.stderr.strip().splitlines()
        assert second.returncode == 2 and len(lines) == 1, second.stderr
        assert f"{run_dir} is in use by another `dapo up` (pid {proc.pid})" in lines[0]
        proc.send_signal(signal.SIGINT)  # what Ctrl-C sends the launcher
        out, _ = proc.communicate(timeout=150)  # > the launcher's learner grace (125 s)
    finally:
        proc.kill()
    assert proc.returncode == 130, out[-3000:]
    assert not children_of(run_dir)

    # The report was written once every service had stopped: its last step is the
    # learner's last step, and the checkpoint it saved on SIGTERM is that step.
    report = json.loads((run_dir / "report.json").read_text())
    last = max(logged_steps(learner_log))
    assert max(s["step"] for s in report["steps"]) == last == report["checkpoint_step"]
    assert f"run tiny: {last} steps" in out

    # The run's Redis is gone; `dapo ledger --run` starts it again from the directory.
    ledger = dapo("ledger", "--run", str(run_dir), "--json")
    assert ledger.returncode == 0, ledger.stderr
    counts = json.loads(ledger.stdout)
    assert counts["ok"] and counts["version"] == last and counts["trained"] == 16 * last
    assert counts == report["ledger"]

    # `dapo eval --run`: the run's model, data, verifier, length, chat setting and seed.
    results = []
    for name in ("a", "b"):
        out_file = tmp_path / f"{name}.json"
        result = dapo(
            "eval", "--run", str(run_dir), "--limit", "10", "--n", "2", "--out", str(out_file)
        )
        assert result.returncode == 0, result.stderr[-2000:]
        results.append(json.loads(out_file.read_text()))
    first, again = results
    # Interrupted: no final export; its latest checkpoint (the one written on stop).
    assert (first["checkpoint"], first["step"], first["version"]) == (f"step{last}", last, last)
    assert first["model"] == str(run_dir / "eval-models" / f"step{last}")
    assert (first["data"], first["verifier"], first["max_tokens"]) == (
        "synthetic:max3",
        "first_integer",
        4,
    )
    assert first["chat_template"] is False and first["seed"] == 0 and first["top_p"] == 0.7
    assert first["per_prompt"] == again["per_prompt"]  # seeded: the same samples
