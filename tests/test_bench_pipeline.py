"""The arithmetic of benchmarks/pipeline.py: pooling runs, the overlap bound, the CPU floor."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bench() -> Any:
    spec = importlib.util.spec_from_file_location("bench_pipeline", ROOT / "benchmarks/pipeline.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # as `dapo bench` loads it
    return module


def run(steps: int, phase: float, learner: float, responses: int, cpu: float | None) -> dict:
    return {
        "steps": steps,
        "train_phase_seconds": phase,
        "learner_seconds_per_step": learner,
        "responses_generated": responses,
        "cpu_seconds_per_step": cpu,
    }


def test_pooled_runs_weigh_by_steps_and_time(bench: Any) -> None:
    pooled = bench.pooled([run(10, 2.0, 0.1, 1000, 0.3), run(30, 4.0, 0.2, 3000, None)])
    assert pooled["steps"] == 40 and pooled["train_phase_seconds"] == 6.0
    assert pooled["responses_per_s"] == pytest.approx(4000 / 6.0)
    assert pooled["learner_seconds_per_step"] == pytest.approx((1.0 + 6.0) / 40)
    assert pooled["step_seconds"] == pytest.approx(6.0 / 40)
    assert pooled["cpu_seconds_per_step"] == 0.3  # runs without a CPU reading are left out


def test_overlap_bound_and_cpu_floor(bench: Any) -> None:
    # sync: 0.2 s per step of which 0.1 s training -> T_gen = T_train = 0.1, bound 2.
    sync = bench.pooled([run(10, 2.0, 0.1, 1000, 0.25)])
    asyn = bench.pooled([run(10, 1.25, 0.12, 1000, 0.3)])
    overlap = bench.overlap_of(sync, asyn)
    assert overlap["t_gen_s"] == pytest.approx(0.1) and overlap["t_train_s"] == pytest.approx(0.1)
    assert overlap["ideal_speedup"] == pytest.approx(2.0)
    assert overlap["measured_speedup"] == pytest.approx(1.6)
    assert overlap["fraction_of_ideal"] == pytest.approx(0.8)
    cores = os.cpu_count() or 1
    floor = 0.3 / cores
    assert overlap["cpu_floor_step_s"] == pytest.approx(floor)
    assert overlap["best_speedup_the_cores_allow"] == pytest.approx(0.2 / floor)
    assert overlap["best_fraction_of_ideal_the_cores_allow"] == pytest.approx(
        min(0.2 / floor, 2.0) / 2.0
    )


def test_whole_run_cpu_is_the_sum_of_dapo_ups_own_by_role(bench: Any) -> None:
    report = {"cpu_per_step": {"by_role": {"learner": 0.5, "rollout": 0.25, "redis": 0.25}}}
    assert bench.whole_run_cpu(report) == pytest.approx(1.0)
    assert bench.whole_run_cpu({"cpu_per_step": None}) is None  # too few readings
