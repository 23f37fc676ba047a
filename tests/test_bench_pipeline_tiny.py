"""benchmarks/pipeline_tiny.py's arithmetic: pooled rates, time to 0.9 over the seeds both
reached, and rows that fail when nothing was measured."""

from __future__ import annotations

from typing import Any

from benchmarks.pipeline_tiny import first_at, summarize


def dapo_run(
    phase: float, gen: float, trained: float, curve: list, services: float, load: float = 1.0
) -> dict:
    cpu = {"services": services, "by_role": {}, "steps": 10}
    return {
        "train_phase_s": phase,
        "generated_per_s": gen,
        "trained_per_s": trained,
        "curve": curve,
        "to_first_step_s": 9.0,
        "cpu_per_step": cpu,
        "eval_point_s": [0.2, 0.3, 0.9],
        "load_before": load,
    }


def loop_run(phase: float, gen: float, trained: float, curve: list) -> dict[str, Any]:
    return {
        "train_phase_s": phase,
        "generated_per_s": gen,
        "trained_per_s": trained,
        "curve": curve,
        "eval_point_s": 0.1,
        "load_before": 1.5,
    }


def test_first_at_is_the_first_point_at_or_above() -> None:
    curve = [(10, 0.5, 3.0), (20, 0.9, 6.0), (30, 0.95, 9.0)]
    assert first_at(curve, 0.9) == (20, 6.0) and first_at(curve, 0.99) is None


def test_rates_pool_by_time_and_time_to_target_uses_seeds_both_reached() -> None:
    dapo = [
        dapo_run(10.0, 100.0, 50.0, [(10, 0.9, 4.0)], 0.08),
        dapo_run(30.0, 200.0, 100.0, [(10, 0.5, 4.0)], 0.12),  # never reaches 0.9
    ]
    loop = [
        loop_run(20.0, 300.0, 100.0, [(10, 0.92, 2.0)]),
        loop_run(20.0, 300.0, 100.0, [(10, 0.95, 2.0)]),
    ]
    out = summarize(dapo, loop)
    assert out["pooled"]["generated_per_s_ratio"] == (100 * 10 + 200 * 30) / 40 / 300
    assert out["pooled"]["trained_per_s_ratio"] == (50 * 10 + 100 * 30) / 40 / 100
    assert out["per_pair"]["generated_per_s_ratio"] == [0.333, 0.667]
    assert out["per_pair"]["time_to_0.9_ratio"] == [2.0]  # seed 1 only: 4.0 / 2.0
    assert out["per_pair"]["eval_point_ratio"] == [3.0, 3.0]  # median 0.3 / 0.1
    assert out["service_cpu_per_step_max"] == 0.12
    checks = {c["name"]: c for c in out["checks"]}
    # N of N: a check's value is its worst pair's
    assert checks["generated responses/s: dapo / loop (worst pair)"]["value"] == 0.333
    assert not checks["generated responses/s: dapo / loop (worst pair)"]["ok"]
    assert checks["trained responses/s: dapo / loop (worst pair)"]["value"] == 0.5
    assert not checks["eval point seconds: dapo / loop (worst pair)"]["ok"]
    assert checks["load average before a run (max): the bound these figures need"]["ok"]
    assert not checks["dapo seeds reaching 0.9 of 2"]["ok"]
    assert checks["dapo seeds reaching 0.9 of 2"]["value"] == 1.0
    assert not checks["service CPU s per step, all but learner and model (max over runs)"]["ok"]
    assert checks["dapo up to its first step, s (max over runs)"]["ok"]


def test_no_seed_reached_by_both_is_a_failed_row_not_a_pass() -> None:
    dapo = [dapo_run(10.0, 1.0, 1.0, [(10, 0.5, 4.0)], 0.05)]
    loop = [loop_run(10.0, 1.0, 1.0, [(10, 0.95, 2.0)])]
    row = next(c for c in summarize(dapo, loop)["checks"] if c["name"].startswith("time to"))
    assert row["ok"] is False and row["value"] == "no seed reached 0.9 in both"


def test_a_busy_machine_fails_the_load_row() -> None:
    dapo = [dapo_run(10.0, 1.0, 1.0, [(10, 0.95, 4.0)], 0.05, load=2.6)]
    loop = [loop_run(10.0, 1.0, 1.0, [(10, 0.95, 2.0)])]
    row = next(c for c in summarize(dapo, loop)["checks"] if c["name"].startswith("load"))
    assert row["ok"] is False and row["value"] == 2.6
