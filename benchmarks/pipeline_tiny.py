"""The tiny preset end to end against a minimal single-process DAPO loop.

`dapo up --preset tiny` (what `make demo` runs: every service, its own Redis, the eval
curve every 10 steps) and benchmarks/_plain_dapo.py (the same model, task, verifier,
filter, loss and optimiser in one process, refilling each batch until full, evaluating
the same held-out split every 10 steps) trained for the same steps from the same model,
interleaved seed by seed (dapo, loop, dapo, loop, ...), each run started once the load
average fell below 1.5 (at most 90 s of waiting), the load before each run recorded.

Checks (issue #37, item 6): generated and trained responses/s of dapo's training phase
÷ the loop's (≥ 0.5, ≥ 0.7), time to held-out avg@4 ≥ 0.9 ÷ the loop's (≤ 1.5, over the
seeds both reach it), and every dapo seed reaching 0.9; item 2's service CPU per step
(≤ 0.1 s, from `dapo up`'s own `CPU per step`), item 3's start (`dapo up` to its first
step ≤ 15 s) and eval point (≤ 2× the loop's). Each ratio is taken per seed pair and a
check holds only if it holds for every pair (item 5: N of N); the load average before
each run is recorded, and a last row says whether it stayed under the 2.0 these
figures need on this 2-core machine.
Details: benchmarks/README.md, "`pipeline_tiny`".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._results import at_least, at_most, check, machine, result_path, write_result
from services.tools.bench import settle
from services.tools.cli import up_argv

ROOT = Path(__file__).resolve().parent.parent
RESULTS = result_path("pipeline_tiny")
STEPS = 150
EVERY = 10
REPEATS = 1  # `dapo bench` runs it once: its three interleaved seed pairs are its repeats
TARGET = 0.9
LOAD_BELOW = 1.5  # each run starts once the load average fell below this


def group_size() -> int:
    """The tiny preset's group size: responses per group, on both sides."""
    from services.tools.config import load_config

    return load_config(preset="tiny", env={}).shared.group_size


def first_at(curve: list[tuple[int, float, float]], target: float) -> tuple[int, float] | None:
    """(step, seconds) of the first curve point at or above `target`."""
    return next(((step, t) for step, acc, t in curve if acc >= target), None)


def run_dapo(work: Path, model: Path, seed: int, steps: int) -> dict[str, Any]:
    """`dapo up` as a user starts it; rates over its training phase (first step's start
    to the last commit), times from that start to the commit of each evaluated version."""
    run_dir, before = work / f"dapo-{seed}", settle(LOAD_BELOW)
    argv = [*up_argv(run_dir, model), "--steps", str(steps), "--eval-every", str(EVERY)]
    argv += ["--set", f"shared.seed={seed}", "--set", f"shared.run_name=bench{seed}"]
    started = time.time()
    done = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT)
    wall = time.time() - started
    if done.returncode != 0:
        raise RuntimeError(f"dapo up (seed {seed}) failed: {done.stderr[-2000:]}")
    report = json.loads((run_dir / "report.json").read_text())
    steps_done, ledger = report["steps"], report["ledger"]
    start = steps_done[0]["committed_at"] - steps_done[0]["seconds"]
    phase = steps_done[-1]["committed_at"] - start
    committed = {s["step"]: s["committed_at"] - start for s in steps_done}
    curve = [
        (p["version"], p["avg@4"], committed[p["version"]])
        for p in report["eval_curve"]
        if p["version"] in committed
    ]
    return {
        "seed": seed,
        "load_before": before,
        "wall_s": round(wall, 2),
        "to_first_step_s": round(steps_done[0]["committed_at"] - started, 2),
        "train_phase_s": round(phase, 2),
        "generated_per_s": ledger["scored"] * group_size() / phase,
        "trained_per_s": ledger["trained"] * group_size() / phase,
        "curve": [(v, round(a, 3), round(t, 2)) for v, a, t in curve],
        "eval_point_s": [p["seconds"] for p in report["eval_curve"]],
        "eval_after": report["eval_after"]["avg@4"],
        "entropy_last_10": statistics.fmean(s["entropy"] for s in steps_done[-10:]),
        "cpu_per_step": report["cpu_per_step"],
        "ledger_ok": ledger["ok"],
    }


def run_loop(model: Path, seed: int, steps: int) -> dict[str, Any]:
    """The minimal loop, in this process (one thread, like the preset's learner)."""
    import torch

    from benchmarks import _plain_dapo as plain
    from services.tools.config import load_config

    before = settle(LOAD_BELOW)
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    sets = [f"shared.model_path={model}", f"shared.seed={seed}"]
    result = plain.run_plain(load_config(preset="tiny", env={}, overrides=sets), steps, EVERY)
    phase = result.wall_seconds
    return {
        "seed": seed,
        "load_before": before,
        "train_phase_s": round(phase, 2),
        "eval_s": round(result.eval_seconds, 2),
        "eval_point_s": result.eval_seconds / max(1, len(result.curve)),
        "generated_per_s": result.responses / phase,
        "trained_per_s": result.groups_trained * group_size() / phase,
        "curve": [
            (c["step"], round(c["held_out"], 3), round(c["seconds"], 2)) for c in result.curve
        ],
    }


def summarize(dapo: list[dict[str, Any]], loop: list[dict[str, Any]]) -> dict[str, Any]:
    """Each ratio per seed pair (dapo ÷ the loop run after it) and pooled; a check holds
    only if it holds for every pair (its value is the worst pair's)."""

    def rate(runs: list[dict[str, Any]], key: str) -> float:
        return sum(r[key] * r["train_phase_s"] for r in runs) / sum(
            r["train_phase_s"] for r in runs
        )

    pairs = list(zip(dapo, loop, strict=True))
    reached = [(first_at(d["curve"], TARGET), first_at(lp["curve"], TARGET)) for d, lp in pairs]
    times = [d[1] / lp[1] for d, lp in reached if d and lp]
    generated = [d["generated_per_s"] / lp["generated_per_s"] for d, lp in pairs]
    trained = [d["trained_per_s"] / lp["trained_per_s"] for d, lp in pairs]
    evals = [
        statistics.median(d["eval_point_s"]) / lp["eval_point_s"]
        for d, lp in pairs
        if d.get("eval_point_s") and lp.get("eval_point_s")
    ]
    dapo_reached = sum(1 for d, _ in reached if d)
    start_s = max(d["to_first_step_s"] for d in dapo)
    services = [d["cpu_per_step"].get("services") for d in dapo if d["cpu_per_step"]]
    service_cpu = max(services) if services and None not in services else None
    loads = [r["load_before"] for r in dapo + loop if "load_before" in r]
    return {
        "reached_0.9": {
            "dapo": [d and d[0] for d, _ in reached],
            "loop": [lp and lp[0] for _, lp in reached],
        },
        "per_pair": {
            "generated_per_s_ratio": [round(x, 3) for x in generated],
            "trained_per_s_ratio": [round(x, 3) for x in trained],
            "time_to_0.9_ratio": [round(x, 3) for x in times],
            "eval_point_ratio": [round(x, 3) for x in evals],
        },
        "pooled": {
            "generated_per_s_ratio": rate(dapo, "generated_per_s") / rate(loop, "generated_per_s"),
            "trained_per_s_ratio": rate(dapo, "trained_per_s") / rate(loop, "trained_per_s"),
        },
        "service_cpu_per_step_max": service_cpu,
        "load_before_max": max(loads) if loads else None,
        "checks": [
            at_least("generated responses/s: dapo / loop (worst pair)", min(generated), 0.5),
            at_least("trained responses/s: dapo / loop (worst pair)", min(trained), 0.7),
            time_check(max(times) if times else None),
            service_check(service_cpu),
            at_most("dapo up to its first step, s (max over runs)", start_s, 15.0),
            at_least(
                f"dapo seeds reaching 0.9 of {len(dapo)}", float(dapo_reached), float(len(dapo))
            ),
            eval_check(max(evals) if evals else None),
            at_most(
                "load average before a run (max): the bound these figures need", max(loads), 2.0
            )
            if loads
            else check("load average before a run (max)", "not recorded", 2.0, False),
        ],
    }


def eval_check(ratio: float | None) -> dict[str, Any]:
    """Issue #37 item 3: an in-run eval point's seconds (the median point) ÷ the loop's."""
    name = "eval point seconds: dapo / loop (worst pair)"
    if ratio is None:
        return check(name, "not measured", 2.0, False)
    return at_most(name, ratio, 2.0)


def time_check(ratio: float | None) -> dict[str, Any]:
    name = "time to held-out 0.9: dapo / loop (worst pair both reach)"
    if ratio is None:  # no seed where both got there: nothing to compare, not a pass
        return check(name, "no seed reached 0.9 in both", 1.5, False)
    return at_most(name, ratio, 1.5)


def service_check(seconds: float | None) -> dict[str, Any]:
    """Issue #37 item 2: what the services cost per step beside the model and learner
    (`dapo up`'s `CPU per step` line), the worst run's."""
    name = "service CPU s per step, all but learner and model (max over runs)"
    if seconds is None:
        return check(name, "not measured", 0.1, False)
    return at_most(name, seconds, 0.1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="dapo bench pipeline_tiny", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--seeds", type=int, default=3, help="interleaved dapo/loop pairs (seeds 1..N)"
    )
    parser.add_argument("--steps", type=int, default=STEPS, help="training steps per run")
    args = parser.parse_args(argv)
    from learner.init_model import init_model

    load_start = os.getloadavg()
    dapo, loop = [], []
    with tempfile.TemporaryDirectory(prefix="bench-pipeline-tiny-") as tmp:
        model = init_model(Path(tmp) / "model", preset="tiny", seed=0)
        for seed in range(1, args.seeds + 1):
            dapo.append(run_dapo(Path(tmp), model, seed, args.steps))
            print(json.dumps(dapo[-1]), flush=True)
            loop.append(run_loop(model, seed, args.steps))
            print(json.dumps(loop[-1]), flush=True)
    result = {
        "benchmark": "pipeline_tiny",
        "machine": machine(load_start),
        "steps": args.steps,
        "eval_every": EVERY,
        "dapo": dapo,
        "loop": loop,
        **summarize(dapo, loop),
    }
    return write_result(RESULTS, result)


if __name__ == "__main__":
    raise SystemExit(main())
