"""The ablation's results: per-rung summaries, table.md / table.json and the plot."""

from __future__ import annotations

import json
import random
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from services.common.errors import DapoError
from services.tools.ablation_plan import HIGH_TARGET, LOO_NAMES, RUNG_LABELS, Plan


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


def bootstrap_ci(
    values: Sequence[float], level: float = 0.95, resamples: int = 10_000, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean over seeds: resample the seeds with
    replacement, take the (1 - level) / 2 and (1 + level) / 2 quantiles of the means.
    Seeded, so a table re-rendered from its JSON is the same table."""
    if not values:
        raise ValueError("bootstrap_ci needs at least one value")
    rng, n = random.Random(seed), len(values)
    means = sorted(statistics.fmean(rng.choices(values, k=n)) for _ in range(resamples))
    tail = (1 - level) / 2
    lo = means[int(tail * (resamples - 1))]
    hi = means[int(round((1 - tail) * (resamples - 1)))]
    return lo, hi


def plan_info(plan: Plan) -> dict[str, Any]:
    """What the summaries and the table need of a plan (table.json's "plan")."""
    return {k: v for k, v in asdict(plan).items() if k != "base"}


MECHANISM = (
    "truncated_start",
    "truncated_end",
    "length_start",
    "length_end",
    "length_max_end",
    "entropy_start",
    "long_share_start",
    "long_share_end",
    "full_informative",
)


def summarise_rung(info: Mapping[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean, spread and 95% interval over the seeds of one rung (`info`: `plan_info`)."""
    steps, every = info["steps"], info["eval_every"]
    grid = list(range(0, steps + 1, every))
    if grid[-1] != steps:
        grid.append(steps)
    curves = [grid_curve(r["curve"], grid) for r in rows]
    reached = [steps_to(r["curve"], info["target"]) for r in rows]
    high = info.get("target_high", HIGH_TARGET)
    reached_high = [steps_to(r["curve"], high) for r in rows]
    out: dict[str, Any] = {
        "rung": rows[0]["rung"],
        "label": RUNG_LABELS[rows[0]["rung"]],
        "seeds": len(rows),
        "grid": grid,
        "acc_mean": [statistics.fmean(c) for c in zip(*curves, strict=True)],
        "acc_min": [min(c) for c in zip(*curves, strict=True)],
        "acc_max": [max(c) for c in zip(*curves, strict=True)],
        "steps_to_target": reached,
        "reached": sum(r is not None for r in reached),
        "steps_to_high": reached_high,
        "reached_high": sum(r is not None for r in reached_high),
    }
    entropies = [r["entropy_curve"] for r in rows if r.get("entropy_curve")]
    if len(entropies) == len(rows):  # (runs from before the entropy curve was kept: none)
        curves_h = [grid_curve(e, grid) for e in entropies]
        out["entropy_mean"] = [statistics.fmean(c) for c in zip(*curves_h, strict=True)]
        out["entropy_min"] = [min(c) for c in zip(*curves_h, strict=True)]
        out["entropy_max"] = [max(c) for c in zip(*curves_h, strict=True)]
    out["final_acc"] = mean_sd([c[-1] for c in curves])
    out["final_acc_ci95"] = bootstrap_ci([c[-1] for c in curves])
    for key in ("generated_per_trained", "entropy_end", "train_s", "wall_s", *MECHANISM):
        out[key] = mean_sd([r.get(key) for r in rows])
    out["steps_to_target_mean"] = mean_sd(reached)[0]
    out["steps_to_high_mean"] = mean_sd(reached_high)[0]
    return out


def _fmt(pair: tuple[float | None, float | None], digits: int = 2) -> str:
    mean, sd = pair
    if mean is None:
        return "—"
    return f"{mean:.{digits}f} ± {sd:.{digits}f}" if sd else f"{mean:.{digits}f}"


def _mechanism(s: dict[str, Any]) -> str:
    """The mechanism columns: truncation, length and the longest quarter's loss share."""
    cut = f"{_fmt(s['truncated_start'])} → {_fmt(s['truncated_end'])}"
    length = f"{_fmt(s['length_start'], 1)} → {_fmt(s['length_end'], 1)}"
    longest = _fmt(s["length_max_end"], 1)
    share = f"{_fmt(s['long_share_start'])} → {_fmt(s['long_share_end'])}"
    return f"{cut} | {length} ({longest}) | {share}"


def _acc(s: dict[str, Any]) -> str:
    """Held-out accuracy: mean ± sd [95% bootstrap interval] (the mean alone for 1 seed)."""
    lo, hi = s["final_acc_ci95"]
    return _fmt(s["final_acc"]) + (f" [{lo:.2f}, {hi:.2f}]" if s["seeds"] > 1 else "")


def _reach(mean: float | None, reached: int, seeds: int) -> str:
    return "—" if mean is None else f"{mean:.0f} ({reached}/{seeds})"


def _row(s: dict[str, Any]) -> str:
    n = s["seeds"]
    to = (
        f"{_reach(s['steps_to_target_mean'], s['reached'], n)} / "
        f"{_reach(s['steps_to_high_mean'], s['reached_high'], n)}"
    )
    return (
        f"| {s['label']} | {_acc(s)} | {to} | {_fmt(s['generated_per_trained'])} | "
        f"{_fmt(s['full_informative'])} | "
        f"{_fmt(s['entropy_start'])} → {_fmt(s['entropy_end'])} | "
        f"{_fmt(s['train_s'], 0)} | {_fmt(s['wall_s'], 0)} | {_mechanism(s)} |"
    )


def _loo_rows(summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Full DAPO, then each technique off; the ladder's "+ token-level loss" rung stands in
    for "without dynamic sampling" (the same config) where that was not run on its own."""
    by = {s["rung"]: s for s in summary}
    if "no_dynamic_sampling" not in by and "token_level_loss" in by:
        label = RUNG_LABELS["no_dynamic_sampling"] + " (= + token-level loss)"
        by["no_dynamic_sampling"] = {**by["token_level_loss"], "label": label}
    return [by[r] for r in ("dynamic_sampling", *LOO_NAMES) if r in by]


def table_md(info: Mapping[str, Any], summary: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The Markdown tables (mean ± sd over seeds, and the 95% interval of the mean): the
    ladder, then leave-one-out (with full DAPO's row again) where the plan has it."""
    n, overrides = info["eval_n"], info["overrides"]
    high = info.get("target_high", HIGH_TARGET)
    head = (
        f"| rung | held-out avg@{n} at step {info['steps']}, mean ± sd [95% CI] | steps to "
        f"avg@{n} ≥ {info['target']} / ≥ {high} (seeds) | generated / trained | steps "
        "with only informative groups | entropy, first → last tenth | train s | wall s | "
        "truncated, first → last tenth | length, first → last tenth (longest at end) | "
        "longest quarter's share of the loss, first → last tenth |"
    )
    rule = "|" + "---|" * head.count(" | ") + "---|"
    lines = [
        f"Ablation `{info['name']}`: {len(info['seeds'])} seed(s), {info['steps']} steps per "
        f"run, held-out eval every {info['eval_every']} steps. Load average at the end: "
        f"{meta['loadavg']}; total {meta['total_s'] / 60:.1f} min."
        + (f" Base config overrides: `{' '.join(overrides)}`." if overrides else ""),
    ]
    ladder = [s for s in summary if s["rung"] not in LOO_NAMES]
    loo = [s for s in summary if s["rung"] in LOO_NAMES]
    if ladder:
        lines += ["", head, rule, *map(_row, ladder)]
    if loo:
        lines += [
            "",
            "Leave-one-out from full DAPO:",
            "",
            head,
            rule,
            *map(_row, _loo_rows(summary)),
        ]
    return "\n".join(lines) + "\n"


def rendered(data: dict[str, Any]) -> dict[str, Any]:
    """table.json's content with its summary computed from its runs (what `dapo ablate`
    writes, and how an older file is brought to today's table: `--rerender`)."""
    info, runs = data["plan"], data["runs"]
    by_rung = [[r for r in runs if r["rung"] == rung] for rung in info["rungs"]]
    summary = [summarise_rung(info, group) for group in by_rung if group]
    return {"plan": info, "meta": data["meta"], "summary": summary, "runs": runs}


def read_table(path: Path) -> dict[str, Any]:
    """A `dapo ablate` table.json, or a DapoError saying why it cannot be one."""
    if not path.is_file():
        raise DapoError(f"{path} not found: --rerender takes a `dapo ablate` output directory")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DapoError(f"{path} is not a `dapo ablate` table: {exc}") from None
    missing = [k for k in ("plan", "meta", "runs") if not isinstance(data, dict) or k not in data]
    if missing:
        raise DapoError(f"{path} is not a `dapo ablate` table: no {', '.join(missing)}")
    return dict(data)


def rerender(directory: Path) -> list[Path]:
    """Rewrite a finished ablation's table.json and table.md from its runs."""
    data = rendered(read_table(directory / "table.json"))
    (directory / "table.json").write_text(json.dumps(data, indent=2))
    (directory / "table.md").write_text(table_md(data["plan"], data["summary"], data["meta"]))
    return [directory / "table.json", directory / "table.md"]


def write_plot(
    plan: Plan, summary: list[dict[str, Any]], path: Path, what: str = "acc"
) -> Path | None:
    """Held-out accuracy (`what="acc"`) or policy entropy (`"entropy"`) vs step: the seed
    mean per rung, shaded between min and max."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'dapo[plots]')")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    for s in summary:
        (line,) = ax.plot(s["grid"], s[f"{what}_mean"], marker=".", label=s["label"])
        ax.fill_between(
            s["grid"], s[f"{what}_min"], s[f"{what}_max"], color=line.get_color(), alpha=0.15
        )
    if what == "acc":
        ax.axhline(plan.target, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("training step (policy version)")
    ax.set_ylabel(f"held-out avg@{plan.eval_n}" if what == "acc" else "entropy (nats/token)")
    ax.set_title(f"DAPO ablation ({plan.name}, {len(plan.seeds)} seeds: mean, min–max)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def write_outputs(plan: Plan, rows: list[dict[str, Any]], meta: dict[str, Any]) -> list[Path]:
    """table.json (every run and the summary), table.md and accuracy.png."""
    data = rendered({"plan": plan_info(plan), "meta": meta, "runs": rows})
    out = plan.out_dir
    (out / "table.json").write_text(json.dumps(data, indent=2))
    (out / "table.md").write_text(table_md(data["plan"], data["summary"], meta))
    written = [out / "table.json", out / "table.md"]
    pngs = [write_plot(plan, data["summary"], out / "accuracy.png")]
    if all("entropy_mean" in s for s in data["summary"]):
        pngs.append(write_plot(plan, data["summary"], out / "entropy.png", "entropy"))
    return written + [p for p in pngs if p]
