"""The pipeline's asynchrony on a simulated cluster: the real services, devices that cost time.

Real services with a rollout engine and trainer that sleep instead of computing
(benchmarks/_sim_standins.py), in four modes: synchronous (the baseline), one-step-off,
and fully async without and with partial rollouts. Checks: one-step-off ≥ 0.9 of its
ideal bound; async with partial rollouts ≥ 2.5 x synchronous trained tokens/s; every
group within its staleness bound; the ledger exact. The modes, their bounds and the
stand-ins: benchmarks/README.md, "`pipeline_sim`".
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks._results import at_least, machine, result_path, write_result
from benchmarks._sim_cluster import Mode, Shape, run_isolated
from benchmarks._sim_standins import TAIL, SimCosts, mean_length

RESULTS = result_path("pipeline_sim")
ASYNC_STALENESS = 4


def modes(k: int) -> list[Mode]:
    return [
        Mode("synchronous", 0, False, hard=0),
        Mode("one_step_off", 1, False, hard=1),
        Mode("async", k, False),
        Mode("async_partial", k, True),
    ]


def bounds(results: dict[str, dict], costs: SimCosts) -> dict[str, Any]:
    """T_gen, T_train and T_gen_full from the synchronous run; each mode's speedup over
    it and the fraction of its ideal bound that speedup reaches."""
    sync = results["synchronous"]
    t_train = sync["t_train_s"]
    t_gen = sync["step_s"] - t_train
    t_full = sync["generated_tokens_per_step"] * costs.token_s / costs.slots
    ideal = {
        "synchronous": 1.0,
        "one_step_off": (t_gen + t_train) / max(t_gen, t_train),
        "async": (t_gen + t_train) / max(t_full, t_train),
        "async_partial": (t_gen + t_train) / max(t_full, t_train),
    }
    per_mode = {}
    for name, r in results.items():
        speedup = r["trained_tokens_per_s"] / sync["trained_tokens_per_s"]
        per_mode[name] = {
            "speedup": round(speedup, 3),
            "ideal_speedup": round(ideal[name], 3),
            "fraction_of_ideal": round(speedup / ideal[name], 3),
        }
    times = {"t_gen_s": t_gen, "t_train_s": t_train, "t_gen_full_s": t_full}
    return {"times": {k: round(v, 4) for k, v in times.items()}, "modes": per_mode}


def checks(results: dict[str, dict], summary: dict[str, Any]) -> list[dict[str, Any]]:
    per_mode = summary["modes"]
    within = all(r["staleness_max"] <= r["staleness_bound"] for r in results.values())
    ledger_exact = all(r["ledger"]["ok"] for r in results.values())
    return [
        at_least(
            "one-step-off speedup / its ideal bound",
            per_mode["one_step_off"]["fraction_of_ideal"],
            0.9,
        ),
        at_least(
            "fully async + partial rollouts: trained tokens/s vs synchronous",
            per_mode["async_partial"]["speedup"],
            2.5,
        ),
        at_least("every trained group within its staleness bound", float(within), 1.0),
        at_least("ledger exact in every mode", float(ledger_exact), 1.0),
    ]


def engine_assumed() -> dict[str, Any]:
    """The production engine the stand-in takes its capabilities from, and those taken."""
    from rollout.config import VllmEngineConfig
    from rollout.vllm_engine import VllmEngine

    calls = VllmEngine.concurrency(VllmEngineConfig())
    return {
        "stands_for": "vllm",
        "max_concurrent_calls": calls,
        "groups_merged": calls == 1,
        "continuous_batching": True,
        "partial_rollouts": "abort and resubmit on a swap",
    }


def measure(shape: Shape, costs: SimCosts, k: int) -> dict[str, dict]:
    from learner.init_model import init_model
    from services.common.redis_server import start_redis

    results = {}
    with tempfile.TemporaryDirectory(prefix="dapo-bench-sim-") as tmp:
        model = init_model(Path(tmp) / "model", preset="tiny", seed=0)  # tokenizer only
        redis_server = start_redis()
        try:
            for mode in modes(k):
                started = time.monotonic()
                results[mode.name] = run_isolated(mode, model, redis_server.url, shape, costs)
                results[mode.name]["wall_s"] = round(time.monotonic() - started, 2)
                summary = {k: v for k, v in results[mode.name].items() if k != "ledger"}
                print(f"{mode.name}: {json.dumps(summary)}", flush=True)
        finally:
            redis_server.stop()
    return results


def main(argv: list[str] | None = None) -> int:
    """Run the four modes, write benchmarks/results/pipeline_sim.json; 0 if every check is ok."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=Shape.steps, help="steps per mode")
    parser.add_argument("--staleness", type=int, default=ASYNC_STALENESS, help="fully async K")
    args = parser.parse_args(argv)
    shape, costs = Shape(steps=args.steps), SimCosts()
    load_start = os.getloadavg()
    results = measure(shape, costs, args.staleness)
    summary = bounds(results, costs)
    result = {
        "machine": machine(load_start),
        "shape": asdict(shape),
        "costs": asdict(costs),
        "engine": engine_assumed(),
        "lengths": {
            "l_max": shape.l_max,
            "tail_at_l_max": TAIL,
            "mean": round(mean_length(shape.l_max), 1),
        },
        **summary,
        "runs": results,
        "checks": checks(results, summary),
    }
    return write_result(RESULTS, result)


if __name__ == "__main__":
    raise SystemExit(main())
