"""`dapo ablate`: the DAPO paper's ablation ladder (its Table 1) at toy scale.

Every rung (naive GRPO, + overlong filtering, + clip-higher, + soft overlong punishment,
+ token-level loss, + dynamic sampling = DAPO) is a real `dapo up` run on `runmax`
(`--preset tiny_mixed`: the `mixed` task), once per seed, with held-out accuracy measured
while it trains. Outputs go to runs/ablate-<name>/. The switch per rung, the outputs and
the results: docs/ablation.md.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.common.errors import DapoError
from services.tools.ablation_plan import RUNG_LABELS, Plan, run_config
from services.tools.ablation_table import write_outputs
from services.tools.config import DapoConfig

# --------------------------------------------------------------------------- evaluation


class HeldOut:
    """avg@n on the task's test split, with one reward pool kept for the whole ablation."""

    def __init__(self, config: DapoConfig, n: int) -> None:
        from rollout.engine import SamplingParams
        from services.tools.evaluate import eval_plan, eval_scorer

        enabled = config.model_copy(deep=True)
        enabled.controller.eval.enabled = True  # the runs themselves skip it; we do it here
        plan = eval_plan(enabled)
        if plan is None:
            raise DapoError("no held-out data: use a synthetic task or set controller.eval.data")
        self.plan = plan
        self.params = SamplingParams(
            n=n, temperature=plan.temperature, top_p=plan.top_p, max_tokens=plan.max_tokens
        )
        self.scorer = eval_scorer(num_workers=1)

    def accuracy(self, engine: Any) -> float:
        from services.tools.evaluate import sample_texts, score_correct, summarise

        records = self.plan.records
        texts = sample_texts(engine, records, self.params, self.plan.chat)
        correct = score_correct(self.scorer, records, texts, self.plan.verifier)
        return summarise(correct, self.params.n)[f"avg@{self.params.n}"]

    def close(self) -> None:
        self.scorer.pool.close()


@dataclass
class Curve:
    """Held-out accuracy at the policy versions evaluated during one run."""

    points: list[tuple[int, float]] = field(default_factory=list)
    seconds: float = 0.0

    def add(self, version: int, acc: float) -> None:
        if not self.points or self.points[-1][0] != version:
            self.points.append((version, acc))


def eval_hook(held_out: HeldOut, engine: Any, curve: Curve, every: int) -> Callable:
    """The launcher's on_step: evaluate the latest weights every `every` steps and at the end."""
    from services.tools.evaluate import fetch_latest_weights

    def hook(launch: Any, step: int, done: bool) -> None:
        due = (curve.points[-1][0] if curve.points else 0) + every
        if step < due and not done:
            return
        started = time.monotonic()
        try:
            fetch_latest_weights(launch.config, engine)
            curve.add(engine.version, held_out.accuracy(engine))
        except Exception as exc:  # an evaluation must never take the run down
            print(f"  evaluation at step {step} failed: {exc}", file=sys.stderr)
        curve.seconds += time.monotonic() - started

    return hook


# --------------------------------------------------------------------------- one run


def run_one(plan: Plan, held_out: HeldOut, rung: str, seed: int) -> dict[str, Any]:
    """One `dapo up` of a rung and seed; returns its row (curve and report numbers)."""
    from rollout.torch_engine import TorchEngine
    from services.tools.launcher import ensure_model, launch

    config = run_config(plan, rung, seed)
    ensure_model(config)
    assert config.model_path, "ensure_model sets the model path"
    engine = TorchEngine(config.model_path)
    curve = Curve([(0, held_out.accuracy(engine))])  # the initial model: step 0
    run_dir = plan.out_dir / rung / f"seed{seed}"
    started = time.monotonic()
    code = launch(
        config,
        run_dir=str(run_dir),
        on_step=eval_hook(held_out, engine, curve, plan.eval_every),
        mode="fresh",  # a rerun of the ladder moves the earlier run aside
    )
    wall = time.monotonic() - started
    report = json.loads((run_dir / "report.json").read_text())
    return {
        "rung": rung,
        "seed": seed,
        "exit_code": code,
        "wall_s": round(wall, 1),
        "eval_s": round(curve.seconds, 1),
        "curve": curve.points,
        **run_numbers(report),
    }


def run_numbers(report: dict[str, Any]) -> dict[str, Any]:
    """Entropy at the end, generated per trained group and training time from report.json."""
    steps, ledger = report["steps"], report["ledger"]
    tail = steps[-max(len(steps) // 10, 1) :] if steps else []
    spent = ledger["trained"] + sum(ledger["filtered"].values()) + sum(ledger["dropped"].values())
    # The training phase: from the start of the first step to the commit of the last.
    first, last = (steps[0], steps[-1]) if steps else ({}, {})
    span = last["committed_at"] - first["committed_at"] + first["seconds"] if steps else 0.0
    return {
        "steps": len(steps),
        **mechanism_numbers(steps),
        "entropy_end": statistics.fmean(s["entropy"] for s in tail) if tail else None,
        "entropy_curve": [(s["step"], round(s["entropy"], 4)) for s in steps if "entropy" in s],
        "generated_per_trained": spent / ledger["trained"] if ledger["trained"] else None,
        "train_s": round(span, 1),
        "ledger_ok": ledger["ok"],
        "filtered": sum(ledger["filtered"].values()),
        "dropped_stale": sum(ledger["dropped"].values()),
    }


def mechanism_numbers(steps: list[dict[str, Any]]) -> dict[str, float | None]:
    """What each technique acts on, over the first and the last tenth of the steps:
    truncation and response length (overlong filtering, soft punishment), the longest
    responses and the longest quarter's share of the loss weight (token-level loss),
    entropy (clip-higher), and the share of all steps trained on a batch of informative
    groups only (dynamic sampling)."""
    k = max(len(steps) // 10, 1)
    head, tail = steps[:k], steps[-k:]

    def mean(part: list[dict[str, Any]], key: str) -> float | None:
        values = [s[key] for s in part if key in s]  # reports from before a metric existed
        return statistics.fmean(values) if values else None

    return {
        "truncated_start": mean(head, "truncated_frac"),
        "truncated_end": mean(tail, "truncated_frac"),
        "length_start": mean(head, "response_length"),
        "length_end": mean(tail, "response_length"),
        "length_max_end": mean(tail, "response_length_max"),
        "entropy_start": mean(head, "entropy"),
        "long_share_start": mean(head, "longest_loss_share"),
        "long_share_end": mean(tail, "longest_loss_share"),
        "full_informative": _share_full(steps),
    }


def _share_full(steps: list[dict[str, Any]]) -> float | None:
    """The share of steps whose batch held only informative groups (0 < accuracy < 1)."""
    values = [s["informative_frac"] for s in steps if "informative_frac" in s]
    return sum(v >= 1.0 for v in values) / len(values) if values else None


# --------------------------------------------------------------------------- driver


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def run_ablation(plan: Plan) -> int:
    """Every rung × seed in order; progress lines; outputs rewritten after every run."""
    import torch

    torch.set_num_threads(1)  # the services have the cores; evaluation is small
    plan.out_dir.mkdir(parents=True, exist_ok=True)
    held_out = HeldOut(plan.base, plan.eval_n)
    jobs = [(rung, seed) for rung in plan.rungs for seed in plan.seeds]
    rows: list[dict[str, Any]] = []
    written: list[Path] = []
    start = time.monotonic()
    print(
        f"dapo ablate {plan.name}: {len(plan.rungs)} rungs x {len(plan.seeds)} seeds, "
        f"{plan.steps} steps each -> {plan.out_dir}",
        flush=True,
    )
    try:
        for i, (rung, seed) in enumerate(jobs, start=1):
            print(f"[{i}/{len(jobs)}] {RUNG_LABELS[rung]} seed {seed} ...", flush=True)
            rows.append(run_one(plan, held_out, rung, seed))
            print(progress_line(rows[-1], i, len(jobs), time.monotonic() - start), flush=True)
            meta = {"loadavg": loadavg(), "total_s": time.monotonic() - start}
            written = write_outputs(plan, rows, meta)
    finally:
        held_out.close()
    for path in written:
        print(f"wrote {path}")
    return 0 if all(r["exit_code"] == 0 for r in rows) else 1


def progress_line(row: dict[str, Any], i: int, n: int, elapsed: float) -> str:
    final = row["curve"][-1][1]
    eta = elapsed / i * (n - i)
    return (
        f"[{i}/{n}] {row['rung']} seed {row['seed']}: held-out {final:.3f} at step "
        f"{row['curve'][-1][0]}, generated/trained {row['generated_per_trained'] or 0:.2f}, "
        f"{row['wall_s']:.0f}s (exit {row['exit_code']}); elapsed {elapsed / 60:.1f} min, "
        f"ETA {eta / 60:.1f} min, load {loadavg()}"
    )
