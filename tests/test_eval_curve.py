"""The eval curve: `dapo up --eval-every N` evaluates held-out accuracy during the run on
its own rollout servers, and the points reach the report, the plot, the progress bar and
the controller's /metrics, while the ledger stays exact (no eval sample is a group)."""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from services.controller.evaluation import due
from services.tools.cli import up_argv
from services.tools.report import summary_lines, write_plots

READY = re.compile(r"dapo controller ready .*http=(\d+)")
GAUGE = re.compile(r"^(dapo_controller_eval_\w+) (\S+)$", re.M)


def test_due_evaluates_first_then_at_each_new_multiple() -> None:
    assert not due(0, 0, None) and not due(50, 0, 10)  # every_steps 0: off
    assert due(0, 5, None) and due(7, 5, None)  # the first point: the current version
    assert not due(0, 5, 0) and not due(4, 5, 0) and due(5, 5, 0)
    assert due(6, 5, 0)  # version moved past 5 during the last evaluation
    assert not due(9, 5, 6) and due(10, 5, 6) and due(17, 5, 6)  # 15 skipped, not made up


def point(version: int, acc: float) -> dict:
    return {
        "version": version,
        "step": version,
        "n": 4,
        "avg@4": acc,
        "pass@4": min(1, 2 * acc),
        "prompts": 10,
        "samples": 40,
        "response_length": 2.0,
        "truncation_rate": 0.0,
        "sample_versions": [version, version],
        "seconds": 1.5,
        "at": 0.0,
    }


def test_report_plots_and_prints_the_curve(tmp_path: Path) -> None:
    curve = [point(0, 0.1), point(5, 0.4), point(10, 0.8)]
    steps = [
        {"step": s, "reward_mean": 0, "accuracy": 0, "response_length": 1, "entropy": 1}
        for s in (1, 2)
    ]
    written = write_plots(steps, {1: 0.5}, tmp_path, curve)
    assert tmp_path / "eval_curve.png" in written
    assert (tmp_path / "eval_curve.png").stat().st_size > 1000
    ledger = {"ok": True, "admitted": 0, "trained": 0, "filtered": {}, "dropped": {}}
    lines = summary_lines(
        {"run": "r", "steps": steps, "wall_seconds": 1, "ledger": ledger, "eval_curve": curve}
    )
    assert "eval curve: 3 points, held-out avg@4 0.100 (v0) → 0.800 (v10), 4.5s" in "\n".join(lines)


def controller_gauges(run_dir: Path) -> dict[str, float]:
    """The eval gauges on the controller's /metrics (empty until it is up)."""
    log = run_dir / "logs" / "controller.log"
    match = READY.search(log.read_text()) if log.exists() else None
    if match is None:
        return {}
    url = f"http://127.0.0.1:{match.group(1)}/metrics"
    try:
        text = urllib.request.urlopen(url, timeout=5).read().decode()
    except OSError:
        return {}
    return {name: float(value) for name, value in GAUGE.findall(text)}


@pytest.mark.slow
def test_a_run_records_an_eval_curve_and_its_ledger_stays_exact(
    tmp_path: Path, tiny_model: Path
) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [
            *up_argv(run_dir, tiny_model),
            "--steps",
            "16",
            "--eval-every",
            "2",
            "--set",
            "controller.eval.limit=40",
            "--set",
            "learner.generation_budget=null",
        ],  # full batches: 16 x 16 trained
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    gauges: dict[str, float] = {}
    try:
        deadline = time.monotonic() + 240
        while proc.poll() is None and time.monotonic() < deadline:
            seen = controller_gauges(run_dir)
            if seen.get("dapo_controller_eval_step", 0) >= 2:
                gauges = seen
                break
            time.sleep(0.5)
        out, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    report = json.loads((run_dir / "report.json").read_text())
    curve = report["eval_curve"]
    assert len(curve) >= 5, curve
    versions = [p["version"] for p in curve]
    assert versions == sorted(set(versions)) and versions[0] == 0 and versions[-1] <= 16
    # The preset's learner waits for each point (controller.eval.hold_learner): every
    # multiple of 2 is evaluated, on samples of exactly that version.
    assert versions[:8] == list(range(0, 16, 2)), versions
    for p in curve[1:]:
        assert p["sample_versions"] == [p["version"], p["version"]], p
    learner_log = (run_dir / "logs" / "learner.log").read_text()
    for version in range(2, 16, 2):
        assert f"for the eval point of version {version}\n" in learner_log
    assert [p["step"] for p in curve] == sorted(p["step"] for p in curve)
    for p in curve:
        assert (p["n"], p["prompts"], p["samples"]) == (4, 40, 160)
        assert 0.0 <= p["avg@4"] <= p["pass@4"] <= 1.0
        assert 0 < p["response_length"] <= 4 and 0.0 <= p["truncation_rate"] <= 1.0
        assert p["sample_versions"][0] >= p["version"] and p["seconds"] > 0
    assert curve[-1]["avg@4"] > curve[0]["avg@4"]  # it learns, and the curve shows it
    # The ledger is exact: every admitted group is accounted for, and no eval sample was
    # admitted, scored or trained as a group.
    ledger = report["ledger"]
    assert ledger["ok"], ledger["problems"]
    assert ledger["trained"] == 16 * 16
    assert (run_dir / "plots" / "eval_curve.png").stat().st_size > 1000
    assert f"eval curve: {len(curve)} points" in out
    # What each role's processes cost per step; the rollout server's model work apart.
    cpu = report["cpu_per_step"]
    assert {"controller", "buffer", "reward", "redis", "rollout", "learner"} <= set(cpu["by_role"])
    assert cpu["model"] > 0 and cpu["by_role"]["learner"] > 0 and cpu["services"] > 0
    outside = cpu["by_role"]["rollout"] - cpu["model"]  # (each rounded to 4 places)
    assert cpu["rollout_outside_model"] == pytest.approx(outside, abs=2e-4)
    assert f"CPU per step (s, over {cpu['steps']} steps): services {cpu['services']:.3f}" in out
    assert re.search(r"eval=\d\.\d\d@v\d+", err)  # the progress bar's last eval
    assert gauges["dapo_controller_eval_step"] >= 2, gauges
    assert 0.0 <= gauges["dapo_controller_eval_accuracy"] <= 1.0
    assert 0.0 <= gauges["dapo_controller_eval_truncation_rate"] <= 1.0
    controller_log = (run_dir / "logs" / "controller.log").read_text()
    assert "eval v0 (step 0): avg@4" in controller_log
