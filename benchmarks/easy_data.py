"""Dynamic sampling when the data gets easy: `dapo up --preset tiny` (the launcher, real
services) past the point where max3 is nearly solved.

1. Easy tail: steps/s over the last 50 of 150 steps against the first 100, in one run
   (≥ 0.5); the same run with difficulty-aware admission (`controller.difficulty_window`
   2, the global default; the preset samples every prompt every epoch) reports what that
   back-off changes in generated per trained groups (no target: it saved nothing here,
   which is why the preset turned it off).
2. The demo still learns as fast: seconds to held-out avg@4 ≥ 0.85 with the preset's
   sampling against the paper's, ABBA order (≤ 1.1 x). Method: benchmarks/README.md,
   "`easy_data`".
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
RESULTS = result_path("easy_data")
PAPER_SAMPLING = ["learner.generation_budget=null", "controller.difficulty_window=0"]
BACKOFF = ["controller.difficulty_window=2"]  # the global default; the tiny preset: 0
THRESHOLDS = (0.8, 0.85, 0.9)
# The check's threshold: the demo plateaus at 0.89-0.90 held-out avg@4 by step 100, so in
# the first run of this benchmark neither sampling reached 0.9 on the curve (0.895 both).
TARGET_ACCURACY = 0.85


def dapo_up(run_dir: Path, model: Path, steps: int, sets: list[str]) -> dict[str, Any]:
    """One `dapo up --preset tiny` as a user runs it; its report.json and wall seconds."""
    started = time.monotonic()
    args = [arg for s in sets for arg in ("--set", s)]
    result = subprocess.run(
        [*up_argv(run_dir, model), "--steps", str(steps), *args],
        capture_output=True,
        text=True,
        cwd=ROOT.parent,
    )
    if result.returncode != 0:
        raise RuntimeError(f"dapo up failed: {result.stderr[-2000:]}")
    report = json.loads((run_dir / "report.json").read_text())
    report["wall_s"] = round(time.monotonic() - started, 1)
    return report


def commits(report: dict[str, Any]) -> dict[int, float]:
    return {s["step"]: s["committed_at"] for s in report["steps"]}


def run_summary(report: dict[str, Any]) -> dict[str, Any]:
    sampling = report["dynamic_sampling"]
    return {
        "wall_s": report["wall_s"],
        "steps": len(report["steps"]),
        "generated_per_trained": sampling["generated_per_trained"],
        "short_steps": sampling["short_steps"],
        "groups_admitted": report["ledger"]["admitted"],
        "groups_trained": sum(s.get("groups", 0) for s in report["steps"]),
        "load_after": round(float(Path("/proc/loadavg").read_text().split()[0]), 2),
    }


def easy_tail(report: dict[str, Any]) -> dict[str, Any]:
    """Steps/s over all steps but the last 50 and over those 50 (commit times), and their
    ratio; with 150 steps: the first 100 and the last 50."""
    t = commits(report)
    n = max(t)
    split = n - 50
    first = (split - 1) / (t[split] - t[1])
    last = 50 / (t[n] - t[split])
    return dict(
        run_summary(report),
        first_100_steps_per_s=round(first, 3),
        last_50_steps_per_s=round(last, 3),
        ratio=round(last / first, 3),
    )


def time_to_accuracy(report: dict[str, Any]) -> dict[str, Any]:
    """Per threshold: steps and seconds from the first commit to the first eval point at
    or above it (None if the curve never gets there)."""
    t = commits(report)
    curve = [(p["version"], p["avg@4"]) for p in report["eval_curve"]]
    reached = {
        str(x): next((v for v, acc in curve if acc >= x and v in t), None) for x in THRESHOLDS
    }
    return dict(
        run_summary(report),
        curve=[(v, round(acc, 3)) for v, acc in curve],
        steps_to=reached,
        seconds_to={x: None if v is None else round(t[v] - t[1], 1) for x, v in reached.items()},
        eval_after=report.get("eval_after", {}).get("avg@4"),
    )


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def backoff_ratio(tail: dict[str, Any], backoff: dict[str, Any]) -> float:
    """Generated per trained groups with difficulty-aware admission ÷ the preset's plain
    admission, in the easy tail (< 1: the back-off saves generation)."""
    return round(backoff["generated_per_trained"] / tail["generated_per_trained"], 3)


def checks(tail: dict[str, Any], demos: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = [
        check(
            "easy tail: steps/s last 50 / first 100",
            tail["ratio"],
            ">= 0.5",
            tail["ratio"] >= 0.5,
        ),
    ]
    if not demos:
        return out
    seconds = {
        mode: [d["seconds_to"][str(TARGET_ACCURACY)] for d in demos if d["mode"] == mode]
        for mode in ("paper", "preset")
    }
    reached = all(s is not None for v in seconds.values() for s in v)
    ratio = mean(seconds["preset"]) / mean(seconds["paper"]) if reached else None
    out.append(
        check(
            f"demo seconds to held-out {TARGET_ACCURACY}: preset / paper sampling",
            ratio,
            "<= 1.1",
            ratio is not None and ratio <= 1.1,
        )
    )
    return out


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="dapo bench easy_data")
    parser.add_argument("--steps", type=int, default=150, help="steps of the easy-tail run")
    parser.add_argument("--pairs", type=int, default=1, help="ABBA demo blocks (0: none)")
    parser.add_argument(
        "--paper",
        action="store_true",
        help="also run the easy tail with the paper's sampling (slow)",
    )
    args = parser.parse_args(argv)
    from learner.init_model import init_model

    no_eval = ["controller.eval.enabled=false"]
    load = Path("/proc/loadavg").read_text().split()[:3]
    result: dict[str, Any] = {
        "benchmark": "easy_data",
        "machine": platform.machine(),
        "load_before": load,
    }
    with tempfile.TemporaryDirectory(prefix="bench-easy-data-") as tmp:
        model = init_model(Path(tmp) / "model", preset="tiny", seed=0)
        tail = easy_tail(dapo_up(Path(tmp) / "easy", model, args.steps, no_eval))
        print(json.dumps(tail))
        result["easy_tail"] = tail
        backoff = easy_tail(
            dapo_up(Path(tmp) / "easy-backoff", model, args.steps, no_eval + BACKOFF)
        )
        print(json.dumps(backoff))
        result["easy_tail_with_difficulty_admission"] = backoff
        result["generated_per_trained_difficulty_aware_over_plain"] = backoff_ratio(tail, backoff)
        if args.paper:
            paper = easy_tail(
                dapo_up(Path(tmp) / "easy-paper", model, args.steps, no_eval + PAPER_SAMPLING)
            )
            print(json.dumps(paper))
            result["easy_tail_paper_sampling"] = paper
        demos = []
        for block in range(args.pairs):
            for i, mode in enumerate(("paper", "preset", "preset", "paper")):
                sets = PAPER_SAMPLING if mode == "paper" else []
                report = dapo_up(Path(tmp) / f"demo-{block}-{i}", model, 100, sets)
                demos.append(dict(time_to_accuracy(report), mode=mode))
                print(json.dumps(demos[-1]))
        result["demo"] = demos
    result["checks"] = checks(tail, demos)
    write_result(RESULTS, result)


if __name__ == "__main__":
    main(sys.argv[1:])
