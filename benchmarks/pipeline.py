"""The asynchronous pipeline against its baselines, measured in one run on this machine.

1. Overlap: `dapo up` with max_staleness 1 against 0, against the ideal async speedup
   (≥ 0.9 x ideal); 2. service overhead: responses/s of `dapo up` against a plain
   single-process generate-score-train loop (benchmarks/_plain_dapo.py, ≥ 0.5x);
3. dynamic-sampling cost: generated per trained groups with and without
   difficulty-aware admission (reported). Method: benchmarks/README.md, "`pipeline`".
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._results import at_least, at_most, machine, result_path, write_result

RESULTS = result_path("pipeline")
STEPS = 30
REPEATS = 2


def tiny_config(run: str, model: Path, steps: int, *overrides: str) -> Any:
    from services.tools.config import load_config

    return load_config(
        preset="tiny",
        env={},
        overrides=[
            f"shared.run_name={run}",
            f"shared.model_path={model}",
            f"learner.total_steps={steps}",
            "controller.eval.enabled=false",
            "learner.linger_s=0",
            *overrides,
        ],
    )


def whole_run_cpu(report: dict[str, Any]) -> float | None:
    """CPU seconds per step of every process of the run (launcher, services, their
    workers, Redis): the sum of `dapo up`'s own `cpu_per_step` by role."""
    cpu = report.get("cpu_per_step")
    return sum(cpu["by_role"].values()) if cpu else None


def run_up(config: Any, run_dir: Path) -> dict[str, Any]:
    """One `dapo up` (its own Redis, all five processes); returns its report + rates."""
    from services.tools.launcher import launch

    started = time.perf_counter()
    code = launch(config, run_dir=str(run_dir))
    wall = time.perf_counter() - started
    report = json.loads((run_dir / "report.json").read_text())
    steps = report["steps"]
    ledger = report["ledger"]
    # The training phase: from the start of the first step to the commit of the last.
    span = steps[-1]["committed_at"] - steps[0]["committed_at"] if steps else wall
    train_phase = span + (steps[0]["seconds"] if steps else 0.0)
    decided = ledger["kept"] + sum(ledger["filtered"].values())
    responses = ledger["scored"] * config.shared.group_size
    return {
        "exit_code": code,
        "steps": len(steps),
        "wall_seconds": round(wall, 2),
        "train_phase_seconds": round(train_phase, 2),
        "responses_generated": responses,
        "responses_per_s": responses / train_phase,
        "learner_seconds_per_step": sum(s["seconds"] for s in steps) / max(len(steps), 1),
        "step_seconds": train_phase / max(len(steps), 1),
        "groups_generated": ledger["scored"],
        "groups_trained": ledger["trained"],
        "generated_per_trained": ledger["scored"] / max(ledger["trained"], 1),
        "p_informative": ledger["kept"] / max(decided, 1),
        "ledger_ok": ledger["ok"],
        "final_accuracy": steps[-1]["accuracy"] if steps else None,
        "cpu_seconds_per_step": whole_run_cpu(report),
    }


def run_staleness(model: Path, steps: int, staleness: int, run_dir: Path) -> dict[str, Any]:
    name = f"{'async' if staleness else 'sync'}-{run_dir.name}"
    config = tiny_config(name, model, steps, f"shared.max_staleness={staleness}")
    return run_up(config, run_dir)


def pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Several runs of one config as one: rates and per-step times over all their steps."""
    steps = sum(r["steps"] for r in runs)
    phase = sum(r["train_phase_seconds"] for r in runs)
    learner = sum(r["learner_seconds_per_step"] * r["steps"] for r in runs)
    responses = sum(r["responses_generated"] for r in runs)
    cpu = [r["cpu_seconds_per_step"] for r in runs if r["cpu_seconds_per_step"] is not None]
    return {
        "steps": steps,
        "train_phase_seconds": phase,
        "responses_per_s": responses / phase,
        "learner_seconds_per_step": learner / steps,
        "step_seconds": phase / steps,
        "cpu_seconds_per_step": sum(cpu) / len(cpu) if cpu else None,
    }


def overlap_of(sync: dict[str, Any], asyn: dict[str, Any]) -> dict[str, float]:
    """T_gen, T_train from the synchronous run; the ideal and the measured async speedup."""
    t_train = sync["learner_seconds_per_step"]
    t_gen = max(sync["step_seconds"] - t_train, 0.0)
    ideal = (t_gen + t_train) / max(t_gen, t_train)
    speedup = asyn["responses_per_s"] / sync["responses_per_s"]
    return {
        "t_gen_s": t_gen,
        "t_train_s": t_train,
        "ideal_speedup": ideal,
        "measured_speedup": speedup,
        "fraction_of_ideal": speedup / ideal,
        **cpu_floor(sync, asyn, ideal),
    }


def cpu_floor(sync: dict[str, Any], asyn: dict[str, Any], ideal: float) -> dict[str, float]:
    """What the machine's cores allow: no schedule runs an async step in less than its
    CPU seconds / cores, so the speedup cannot pass sync step / that floor."""
    cpu = asyn["cpu_seconds_per_step"]
    if not cpu:
        return {}
    floor = cpu / (os.cpu_count() or 1)
    best = sync["step_seconds"] / floor
    return {
        "async_cpu_seconds_per_step": cpu,
        "cpu_floor_step_s": floor,
        "best_speedup_the_cores_allow": best,
        "best_fraction_of_ideal_the_cores_allow": min(best, ideal) / ideal,
    }


def half_trivial_dataset(path: Path, n: int = 200) -> Path:
    """n max3 prompts, half with an unreachable gold answer ("10": all-wrong groups)."""
    from services.common.data import synthetic_records, write_records

    records = synthetic_records("max3", n, seed=0)
    for record in records[::2]:
        record.ground_truth = "10"
        record.prompt_id += "-unreachable"
    return write_records(records, path)


def plain_rate(model: Path, steps: int) -> dict[str, Any]:
    import torch

    from benchmarks import _plain_dapo as plain

    torch.set_num_threads(1)
    result = plain.run_plain(tiny_config("plain", model, steps), steps)
    return {
        "steps": result.steps,
        "wall_seconds": round(result.wall_seconds, 2),
        "responses_per_s": result.responses / result.wall_seconds,
        "gen_seconds": round(result.gen_seconds, 2),
        "train_seconds": round(result.train_seconds, 2),
        "generated_per_trained": result.groups_generated / max(result.groups_trained, 1),
    }


def measure(steps: int, repeats: int) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The sync/async pairs, the plain loop before and after them, and the mixed runs."""
    from learner.init_model import init_model

    with tempfile.TemporaryDirectory(prefix="dapo-bench-pipeline-") as tmp:
        work = Path(tmp)
        model = init_model(work / "model", preset="tiny", seed=0)
        runs: dict[str, Any] = {}
        for i in range(repeats):
            runs[f"sync{i}"] = run_staleness(model, steps, 0, work / f"sync{i}")
            if i == 0:
                plain_before = plain_rate(model, steps)
            runs[f"async{i}"] = run_staleness(model, steps, 1, work / f"async{i}")
        plain_after = plain_rate(model, steps)
        data = half_trivial_dataset(work / "half.jsonl")
        # The paper's refill-until-full, so generated/trained shows admission alone.
        mixed = [
            "controller.dataset.kind=jsonl",
            f"controller.dataset.path={data}",
            "learner.generation_budget=null",
        ]
        runs["mixed"] = run_up(
            tiny_config("mixed", model, steps, *mixed, "controller.difficulty_window=0"),
            work / "mixed",
        )
        runs["mixed_difficulty"] = run_up(
            tiny_config("mixedd", model, steps, *mixed, "controller.difficulty_window=1"),
            work / "mixedd",
        )
    return runs, plain_before, plain_after


def summarize(
    runs: dict[str, Any], plain_before: dict[str, Any], plain_after: dict[str, Any], repeats: int
) -> dict[str, Any]:
    """The result JSON (without the machine section): ratios and checks."""
    pairs = [(runs[f"sync{i}"], runs[f"async{i}"]) for i in range(repeats)]
    overlap = overlap_of(pooled([s for s, _ in pairs]), pooled([a for _, a in pairs]))
    ideal, speedup = overlap["ideal_speedup"], overlap["measured_speedup"]
    asyn = pooled([a for _, a in pairs])
    plain_rps = (plain_before["responses_per_s"] + plain_after["responses_per_s"]) / 2
    overhead = asyn["responses_per_s"] / plain_rps
    plain_steps_per_s = sum(p["steps"] / p["wall_seconds"] for p in (plain_before, plain_after)) / 2
    mixed, mixed_d = runs["mixed"], runs["mixed_difficulty"]
    return {
        "runs": runs,
        "plain_loop": {
            "before_async": plain_before,
            "after_async": plain_after,
            "responses_per_s": plain_rps,
        },
        "service_overhead": {
            "responses_per_s_ratio": overhead,
            # Trained steps per second, for reference: the target is on responses/s.
            "steps_per_s_ratio": asyn["steps"] / asyn["train_phase_seconds"] / plain_steps_per_s,
        },
        "overlap": overlap | {"per_pair": [overlap_of(s, a) for s, a in pairs]},
        "dynamic_sampling": {
            "inherent_1_over_p": 1 / max(mixed["p_informative"], 1e-9),
            "generated_per_trained": mixed["generated_per_trained"],
            "generated_per_trained_difficulty_aware": mixed_d["generated_per_trained"],
        },
        "checks": [
            at_least("async speedup / ideal overlap bound", speedup / ideal, 0.9),
            at_least("dapo up responses/s / plain loop", overhead, 0.5),
            at_most(
                "generated per trained: difficulty-aware / plain admission",
                mixed_d["generated_per_trained"] / mixed["generated_per_trained"],
                1.0,
            ),
            at_least(
                "ledger holds in every run", float(all(r["ledger_ok"] for r in runs.values())), 1.0
            ),
        ],
    }


def main(argv: list[str] | None = None) -> int:
    """Run every measurement, write the JSON; 0 when every check is ok."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=STEPS, help="training steps per run")
    parser.add_argument("--repeats", type=int, default=REPEATS, help="sync/async run pairs")
    args = parser.parse_args(argv)
    load_start = os.getloadavg()
    runs, plain_before, plain_after = measure(args.steps, args.repeats)
    summary = summarize(runs, plain_before, plain_after, args.repeats)
    result = {"machine": machine(load_start), "steps_per_run": args.steps, **summary}
    return write_result(RESULTS, result)


if __name__ == "__main__":
    raise SystemExit(main())
