"""What the eval curve costs a run: `dapo up --preset tiny` (what `make demo` runs) with
the in-run evaluation off and on (`--eval-every 10`, the preset's), in ABBA order so load
that drifts during the benchmark (this machine is shared) biases neither side.

Checks: the curve slows training by no more than the evaluation itself takes (≤ 1.1);
the curve shows the demo learning; every run with it on stays within `make demo`'s
5 minutes. Details: benchmarks/README.md, "`eval_curve`".
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._results import check, result_path, write_result
from services.tools.cli import up_argv

ROOT = Path(__file__).resolve().parent
RESULTS = result_path("eval_curve")


def run_once(tmp: Path, model: Path, every: int, steps: int, index: int) -> dict[str, Any]:
    run_dir = tmp / f"run-{index}-every{every}"
    started = time.monotonic()
    result = subprocess.run(
        [
            *up_argv(run_dir, model),
            "--steps",
            str(steps),
            "--eval-every",
            str(every),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT.parent,
    )
    wall = time.monotonic() - started
    if result.returncode != 0:
        raise RuntimeError(f"dapo up failed: {result.stderr[-2000:]}")
    report = json.loads((run_dir / "report.json").read_text())
    steps_done, curve = report["steps"], report["eval_curve"]
    return {
        "every": every,
        "wall_s": round(wall, 1),
        "train_span_s": round(steps_done[-1]["committed_at"] - steps_done[0]["committed_at"], 1),
        "eval_s": round(sum(p["seconds"] for p in curve), 1),
        "curve": [(p["version"], round(p["avg@4"], 3), p["seconds"]) for p in curve],
        "eval_before": report["eval_before"]["avg@4"],
        "eval_after": report["eval_after"]["avg@4"],
        "load_after": round(float(Path("/proc/loadavg").read_text().split()[0]), 2),
    }


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def checks(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    on = [r for r in runs if r["every"]]
    off = [r for r in runs if not r["every"]]
    stall = mean([r["train_span_s"] for r in on]) / (
        mean([r["train_span_s"] for r in off]) + mean([r["eval_s"] for r in on])
    )
    points = min(len(r["curve"]) for r in on)
    first = max(r["curve"][0][1] for r in on)
    last = min(r["curve"][-1][1] for r in on)
    wall = max(r["wall_s"] for r in on)
    return [
        check("train span on / (off + eval seconds)", stall, "<= 1.1", stall <= 1.1),
        check("eval points per run (min)", points, ">= 5", points >= 5),
        check(
            "curve first / last avg@4",
            [first, last],
            "<= 0.2 / >= 0.8",
            first <= 0.2 and last >= 0.8,
        ),
        check("dapo up wall seconds with the curve (max)", wall, "<= 300", wall <= 300),
    ]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="dapo bench eval_curve")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--pairs", type=int, default=1, help="ABBA blocks (4 runs each)")
    args = parser.parse_args(argv)
    from learner.init_model import init_model

    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-eval-curve-") as tmp:
        model = init_model(Path(tmp) / "model", preset="tiny", seed=0)
        for block in range(args.pairs):
            for i, every in enumerate((0, 10, 10, 0)):
                runs.append(run_once(Path(tmp), model, every, args.steps, 4 * block + i))
                print(json.dumps(runs[-1]))
    result = {
        "benchmark": "eval_curve",
        "machine": platform.machine(),
        "steps": args.steps,
        "runs": runs,
        "checks": checks(runs),
    }
    write_result(RESULTS, result)


if __name__ == "__main__":
    main(sys.argv[1:])
