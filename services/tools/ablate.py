"""`dapo ablate`: the DAPO paper's ablation ladder (its Table 1) at toy scale.

The paper climbs from naive GRPO through overlong filtering, clip-higher, soft overlong
punishment and token-level loss to dynamic sampling (= full DAPO). Here every rung is a
real `dapo up` run (Redis plus all five services) on the synthetic `mixed` task, once
per seed; the techniques are the config switches each service already reads:

| technique | switch (off → on) |
|---|---|
| overlong filtering | learner.overlong_filtering false → true |
| clip-higher | learner.clip_ratio_high = clip_ratio_low → the preset's (0.28) |
| soft overlong punishment | reward.overlong_punishment false → true |
| token-level loss | learner.loss_agg_mode seq_mean_token_mean → token_mean |
| dynamic sampling | buffer.dynamic_sampling false → true |

Held-out accuracy is measured while each run trains: every `eval_every` steps the
launcher's monitor fetches the learner's latest weights and evaluates them (avg@n on the
task's test split) in this process. Outputs go to runs/ablate-<name>/: table.md,
table.json, accuracy.png, and each run's own directory (logs, report.json).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from services.common.config_loader import cli_overrides, deep_merge
from services.common.errors import DapoError
from services.tools.config import DapoConfig, build_config, load_config


@dataclass(frozen=True)
class Technique:
    """One switch: the config path it sets and its value when the technique is off."""

    name: str
    label: str
    path: str
    off: Callable[[DapoConfig], Any]


# In the paper's order (Table 1); "on" is the base config's own value.
TECHNIQUES: tuple[Technique, ...] = (
    Technique("overlong_filtering", "+ overlong filtering", "learner.overlong_filtering",
              lambda c: False),
    Technique("clip_higher", "+ clip-higher", "learner.clip_ratio_high",
              lambda c: c.learner.clip_ratio_low),
    Technique("soft_overlong", "+ soft overlong punishment", "reward.overlong_punishment",
              lambda c: False),
    Technique("token_level_loss", "+ token-level loss", "learner.loss_agg_mode",
              lambda c: "seq_mean_token_mean"),
    Technique("dynamic_sampling", "+ dynamic sampling (= DAPO)", "buffer.dynamic_sampling",
              lambda c: False),
)  # fmt: skip
RUNG_NAMES = ("naive_grpo", *(t.name for t in TECHNIQUES))
RUNG_LABELS = dict(zip(RUNG_NAMES, ("naive GRPO", *(t.label for t in TECHNIQUES)), strict=True))

# `--preset tiny`: the tiny demo preset on the `mixed` task with a tight length budget.
# L_max 6 and a soft zone of 3 tokens: a random model is truncated ~2/3 of the time, and
# a finished answer ("7<eos>") is 2 tokens, so filtering and the penalty have work to do.
ABLATE_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "base": "tiny",
        "overrides": {
            "shared.max_response_length": 6,
            "shared.overlong_buffer_length": 3,
            "controller.dataset.synthetic_task": "mixed",
            "shared.verifier": "first_integer",
            "controller.eval.enabled": False,
            "reward.overlong_punishment": True,
            "learner.overlong_filtering": True,
            "learner.total_steps": 80,
            "learner.linger_s": 30,
        },
        "eval_every": 5,
        "eval_n": 4,
        "target": 0.5,
    },
}


@dataclass
class Plan:
    """What one `dapo ablate` runs."""

    name: str
    base: DapoConfig
    rungs: list[str]
    seeds: list[int]
    steps: int
    eval_every: int
    eval_n: int
    target: float
    root: str = "runs"
    overrides: list[str] = field(default_factory=list)

    @property
    def out_dir(self) -> Path:
        return Path(self.root) / f"ablate-{self.name}"


def rung_overrides(base: DapoConfig, rung: str) -> dict[str, Any]:
    """The switches of a rung: every technique before it (in paper order) on, the rest off."""
    if rung not in RUNG_NAMES:
        raise DapoError(f"unknown rung {rung!r}; choose from: {', '.join(RUNG_NAMES)}")
    on = RUNG_NAMES.index(rung)  # naive_grpo = 0 techniques on
    return {t.path: _get(base, t.path) if i < on else t.off(base)
            for i, t in enumerate(TECHNIQUES)}  # fmt: skip


def _get(config: Any, path: str) -> Any:
    for part in path.split("."):
        config = getattr(config, part)
    return config


def as_sets(values: dict[str, Any]) -> list[str]:
    """`{"a.b": 1}` → `["a.b=1"]` in the `--set` syntax (JSON values parse as YAML)."""
    return [f"{k}={json.dumps(v)}" for k, v in values.items()]


def run_config(plan: Plan, rung: str, seed: int) -> DapoConfig:
    """The full config of one run: base, the rung's switches, the seed and its model."""
    data = plan.base.model_dump(mode="json")
    sets = {
        **rung_overrides(plan.base, rung),
        "shared.seed": seed,
        "shared.run_name": f"abl-{rung}-s{seed}",
        "shared.model_path": str(plan.out_dir / "models" / f"seed{seed}"),
        "learner.total_steps": plan.steps,
    }
    return build_config(deep_merge(data, cli_overrides(as_sets(sets))))


def make_plan(
    preset: str,
    seeds: int,
    name: str | None = None,
    rungs: Sequence[str] | None = None,
    steps: int | None = None,
    eval_every: int | None = None,
    overrides: Sequence[str] = (),
    root: str = "runs",
) -> Plan:
    """Resolve the ablation preset (plus `--set` overrides on the base config)."""
    if preset not in ABLATE_PRESETS:
        raise DapoError(f"unknown ablation preset {preset!r}; choose: {', '.join(ABLATE_PRESETS)}")
    spec = ABLATE_PRESETS[preset]
    sets = [*as_sets(spec["overrides"]), *overrides]
    base = load_config(preset=spec["base"], env={}, overrides=sets)
    chosen = list(rungs or RUNG_NAMES)
    for rung in chosen:
        rung_overrides(base, rung)  # validates the name
    if seeds < 1:
        raise DapoError("--seeds must be >= 1")
    return Plan(
        name=name or preset, base=base, rungs=chosen, seeds=list(range(seeds)),
        steps=steps or base.learner.total_steps, eval_every=eval_every or spec["eval_every"],
        eval_n=spec["eval_n"], target=spec["target"], root=root, overrides=list(overrides),
    )  # fmt: skip


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
    code = launch(config, run_dir=str(run_dir), on_step=eval_hook(
        held_out, engine, curve, plan.eval_every))  # fmt: skip
    wall = time.monotonic() - started
    report = json.loads((run_dir / "report.json").read_text())
    return {"rung": rung, "seed": seed, "exit_code": code, "wall_s": round(wall, 1),
            "eval_s": round(curve.seconds, 1), "curve": curve.points,
            **run_numbers(report)}  # fmt: skip


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
        "entropy_end": statistics.fmean(s["entropy"] for s in tail) if tail else None,
        "generated_per_trained": spent / ledger["trained"] if ledger["trained"] else None,
        "train_s": round(span, 1),
        "ledger_ok": ledger["ok"],
        "filtered": sum(ledger["filtered"].values()),
        "dropped_stale": sum(ledger["dropped"].values()),
    }


# --------------------------------------------------------------------------- summary


def grid_curve(points: Sequence[tuple[int, float]], grid: Sequence[int]) -> list[float]:
    """Accuracy on a common step grid (linear between evaluated versions, flat beyond)."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    out = []
    for g in grid:
        if g <= xs[0]:
            out.append(ys[0])
        elif g >= xs[-1]:
            out.append(ys[-1])
        else:
            k = next(i for i, x in enumerate(xs) if x >= g)
            frac = (g - xs[k - 1]) / (xs[k] - xs[k - 1])
            out.append(ys[k - 1] + frac * (ys[k] - ys[k - 1]))
    return out


def steps_to(points: Sequence[tuple[int, float]], target: float) -> int | None:
    """The first evaluated step whose accuracy reached `target` (None: never)."""
    return next((v for v, acc in points if acc >= target), None)


def mean_sd(values: Sequence[float | None]) -> tuple[float | None, float | None]:
    vals = [v for v in values if v is not None]
    if not vals:
        return None, None
    return statistics.fmean(vals), statistics.stdev(vals) if len(vals) > 1 else 0.0


def summarise_rung(plan: Plan, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean and spread over the seeds of one rung."""
    grid = list(range(0, plan.steps + 1, plan.eval_every))
    if grid[-1] != plan.steps:
        grid.append(plan.steps)
    curves = [grid_curve(r["curve"], grid) for r in rows]
    reached = [steps_to(r["curve"], plan.target) for r in rows]
    out: dict[str, Any] = {"rung": rows[0]["rung"], "label": RUNG_LABELS[rows[0]["rung"]],
                           "seeds": len(rows), "grid": grid,
                           "acc_mean": [statistics.fmean(c) for c in zip(*curves, strict=True)],
                           "acc_min": [min(c) for c in zip(*curves, strict=True)],
                           "acc_max": [max(c) for c in zip(*curves, strict=True)],
                           "steps_to_target": reached,
                           "reached": sum(r is not None for r in reached)}  # fmt: skip
    out["final_acc"] = mean_sd([c[-1] for c in curves])
    for key in ("generated_per_trained", "entropy_end", "train_s", "wall_s"):
        out[key] = mean_sd([r[key] for r in rows])
    out["steps_to_target_mean"] = mean_sd(reached)[0]
    return out


def _fmt(pair: tuple[float | None, float | None], digits: int = 2) -> str:
    mean, sd = pair
    if mean is None:
        return "—"
    return f"{mean:.{digits}f} ± {sd:.{digits}f}" if sd else f"{mean:.{digits}f}"


def table_md(plan: Plan, summary: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The Markdown table (mean ± sd over seeds)."""
    head = (
        f"| rung | held-out avg@{plan.eval_n} at step {plan.steps} | steps to "
        f"avg@{plan.eval_n} ≥ {plan.target} | generated / trained | entropy at end | "
        "train s | wall s |"
    )
    lines = [
        f"Ablation `{plan.name}`: {len(plan.seeds)} seed(s), {plan.steps} steps per run, "
        f"held-out eval every {plan.eval_every} steps. Load average at the end: "
        f"{meta['loadavg']}; total {meta['total_s'] / 60:.1f} min."
        + (f" Base config overrides: `{' '.join(plan.overrides)}`." if plan.overrides else ""),
        "",
        head,
        "|---|---|---|---|---|---|---|",
    ]
    for s in summary:
        reach = s["steps_to_target_mean"]
        to = "—" if reach is None else f"{reach:.0f} ({s['reached']}/{s['seeds']} seeds)"
        lines.append(
            f"| {s['label']} | {_fmt(s['final_acc'])} | {to} | "
            f"{_fmt(s['generated_per_trained'])} | {_fmt(s['entropy_end'])} | "
            f"{_fmt(s['train_s'], 0)} | {_fmt(s['wall_s'], 0)} |"
        )
    return "\n".join(lines) + "\n"


def write_plot(plan: Plan, summary: list[dict[str, Any]], path: Path) -> Path | None:
    """Held-out accuracy vs step: the seed mean per rung, shaded between min and max."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'dapo[plots]')")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    for s in summary:
        (line,) = ax.plot(s["grid"], s["acc_mean"], marker=".", label=s["label"])
        ax.fill_between(s["grid"], s["acc_min"], s["acc_max"], color=line.get_color(), alpha=0.15)
    ax.axhline(plan.target, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("training step (policy version)")
    ax.set_ylabel(f"held-out avg@{plan.eval_n}")
    ax.set_title(f"DAPO ablation ladder ({plan.name}, {len(plan.seeds)} seeds: mean, min–max)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def write_outputs(plan: Plan, rows: list[dict[str, Any]], meta: dict[str, Any]) -> list[Path]:
    """table.json (every run and the summary), table.md and accuracy.png."""
    by_rung = [[r for r in rows if r["rung"] == rung] for rung in plan.rungs]
    summary = [summarise_rung(plan, group) for group in by_rung if group]
    out = plan.out_dir
    plan_info = {k: v for k, v in asdict(plan).items() if k != "base"}
    data = {"plan": plan_info, "meta": meta, "summary": summary, "runs": rows}
    (out / "table.json").write_text(json.dumps(data, indent=2))
    (out / "table.md").write_text(table_md(plan, summary, meta))
    written = [out / "table.json", out / "table.md"]
    png = write_plot(plan, summary, out / "accuracy.png")
    return written + ([png] if png else [])


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
    print(f"dapo ablate {plan.name}: {len(plan.rungs)} rungs x {len(plan.seeds)} seeds, "
          f"{plan.steps} steps each -> {plan.out_dir}", flush=True)  # fmt: skip
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
