"""What `dapo up` leaves behind: report.json, PNG curves, and a printed summary."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from services.tools.cpu_meter import cpu_line

CURVES = {
    "reward": ("reward_mean", "mean reward"),
    "accuracy": ("accuracy", "training accuracy (trained groups)"),
    "response_length": ("response_length", "mean response length (tokens)"),
    "entropy": ("entropy", "policy entropy (nats/token)"),
    "kept_ratio": ("kept_ratio", "informative (kept) fraction"),
}


def kept_ratios(history: list[dict[str, int]]) -> dict[int, float]:
    """Per observed step: kept / decided among groups decided since the previous one."""
    out: dict[int, float] = {}
    prev = {"kept": 0, "filtered": 0}
    for snap in history:
        kept, filtered = snap["kept"] - prev["kept"], snap["filtered"] - prev["filtered"]
        if kept + filtered:
            out[snap["step"]] = kept / (kept + filtered)
        prev = snap
    return out


def write_plots(
    steps: list[dict[str, Any]],
    ratios: dict[int, float],
    out_dir: Path,
    evals: list[dict[str, Any]] | None = None,
) -> list[Path]:
    """One PNG per curve (matplotlib's Agg backend; no display needed), and
    `eval_curve.png` when the run has in-run eval points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = [plot_eval_curve(evals, out_dir / "eval_curve.png")] if evals else []
    series = {
        key: ([s["step"] for s in steps], [s[key] for s in steps])
        for key, _ in [v for k, v in CURVES.items() if k != "kept_ratio"]
    }
    series["kept_ratio"] = (list(ratios), list(ratios.values()))
    for name, (key, title) in CURVES.items():
        xs, ys = series[key]
        fig, ax = plt.subplots(figsize=(5, 3.2), dpi=100)
        ax.plot(xs, ys, marker="." if len(xs) < 50 else None)
        ax.set_xlabel("step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = out_dir / f"{name}.png"
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written


def plot_eval_curve(points: list[dict[str, Any]], path: Path) -> Path:
    """Held-out avg@n and pass@n against the policy version each point evaluated."""
    import matplotlib.pyplot as plt

    n = points[0]["n"]
    xs = [p["version"] for p in points]
    fig, ax = plt.subplots(figsize=(5, 3.2), dpi=100)
    for key in (f"avg@{n}", f"pass@{n}"):
        ax.plot(xs, [p[key] for p in points], marker="o", label=key)
    ax.set_xlabel("policy version (step)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("held-out accuracy during training")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def eval_curve_line(points: list[dict[str, Any]]) -> str:
    """The eval curve in one printed line: first and last points, their cost."""
    n = points[0]["n"]
    first, last = points[0], points[-1]
    seconds = sum(p["seconds"] for p in points)
    return (
        f"eval curve: {len(points)} points, held-out avg@{n} {first[f'avg@{n}']:.3f} "
        f"(v{first['version']}) → {last[f'avg@{n}']:.3f} (v{last['version']}), "
        f"{seconds:.1f}s of evaluation"
    )


def time_accounting(
    groups: list[dict[str, Any]], traces: list[dict[str, Any]], steps: list[dict[str, Any]]
) -> dict[str, Any]:
    """Where a trained group's time went, in mean seconds per group.

    `groups`: one per scored group (group_id, admitted_at, scored_at and the controller's
    generate_s / score_s); `traces`: the `steps` stream (step, groups); `steps`: the
    learner's metrics (step, seconds, committed_at). For each group a step trained:
    generate (the GenerateGroup call, queueing in the rollout server included), score,
    controller (the rest of admission → scored: routing, retries, publishing), wait
    (scored → its step's commit less the step's training seconds: the buffer, waiting
    for the batch to fill, and the step's weight publication) and train (its step's
    seconds over its groups). `overhead` is score + controller: time
    outside generation and training that is spent on the group itself.
    """
    by_id = {g["group_id"]: g for g in groups if "generate_s" in g}
    by_step = {s["step"]: s for s in steps}
    rows = []
    for trace in traces:
        step = by_step.get(trace["step"])
        if step is None:
            continue
        start = step["committed_at"] - step["seconds"]
        for gid in trace["groups"]:
            if (g := by_id.get(gid)) is None:
                continue
            latency = g["scored_at"] - g["admitted_at"]
            controller = latency - g["generate_s"] - g["score_s"]
            rows.append(
                {
                    "generate": g["generate_s"],
                    "score": g["score_s"],
                    "controller": controller,
                    "wait": start - g["scored_at"],
                    "train": step["seconds"] / len(trace["groups"]),
                    "overhead": g["score_s"] + controller,
                }
            )
    if not rows:
        return {"groups": 0}
    mean = {k: round(sum(r[k] for r in rows) / len(rows), 4) for k in rows[0]}
    return {
        "groups": len(rows),
        "mean_s": mean,
        "overhead_max_s": round(max(r["overhead"] for r in rows), 4),
    }


def summary_lines(report: dict[str, Any]) -> list[str]:
    """The lines printed at the end of `dapo up`."""
    ledger = report["ledger"]
    lines = [
        f"run {report['run']}: {steps_text(report['steps'])} in {report['wall_seconds']:.0f}s"
        f"{segments_text(report.get('segments', []))}, "
        f"ledger {'holds' if ledger['ok'] else 'MISMATCH: ' + '; '.join(ledger['problems'])}",
        f"groups: admitted {ledger['admitted']}, trained {ledger['trained']}, "
        f"filtered {sum(ledger['filtered'].values())}, dropped {sum(ledger['dropped'].values())}"
        f", rejected {sum(ledger.get('rejected', {}).values())}",
        *accounting_lines(ledger),
    ]
    lines.append(staleness_line(report))
    acc = report.get("time_accounting", {})
    if acc.get("groups"):
        m = acc["mean_s"]
        lines.append(
            f"per trained group (mean s): generate {m['generate']:.3f}, train "
            f"{m['train']:.3f}, overhead {m['overhead']:.3f} (score {m['score']:.3f} + "
            f"controller {m['controller']:.3f}), waiting for its batch {m['wait']:.3f}"
        )
    if report.get("cpu_per_step"):
        lines.append(cpu_line(report["cpu_per_step"]))
    if report.get("dynamic_sampling"):
        lines.append(sampling_line(report["dynamic_sampling"]))
    if report.get("eval_curve"):
        lines.append(eval_curve_line(report["eval_curve"]))
    before, after = report.get("eval_before"), report.get("eval_after")
    if before and after:
        key = next(k for k in before if k.startswith("avg@"))
        lines.append(
            f"held-out {key}: {before[key]:.3f} before → {after[key]:.3f} after "
            f"(policy version {after.get('version')})"
        )
    return lines


def training_steps(steps: list[dict[str, Any]]) -> int:
    """Steps trained: a learner restarted from its checkpoint trains the steps after it
    again (the metrics stream then repeats those step numbers), so count step numbers,
    not entries (nor policy versions, which skip the ones a crashed learner lost)."""
    return len({s["step"] for s in steps})


def steps_text(steps: list[dict[str, Any]]) -> str:
    """`60 steps`, or `60 steps (16 trained again after a learner restart)`."""
    trained = training_steps(steps)
    again = len(steps) - trained
    return f"{trained} steps" + (
        f" ({again} trained again after a learner restart)" if again else ""
    )


def segments_text(segments: list[dict[str, Any]]) -> str:
    """` (2 segments: 19.6s + 15.9s)` for a resumed run; nothing for a run of one."""
    if len(segments) < 2:
        return ""
    walls = " + ".join(f"{s.get('wall_s', 0.0):.1f}s" for s in segments)
    return f" ({len(segments)} segments: {walls})"


def sampling_summary(
    steps: list[dict[str, Any]], ledger: dict[str, Any], need: int, budget: float | None
) -> dict[str, Any]:
    """Dynamic sampling's cost: groups the buffer decided per group trained, and the steps
    the generation budget (`learner.generation_budget`) cut short of `need` groups."""
    decided = ledger["kept"] + sum(ledger["filtered"].values())
    trained = sum(int(s.get("groups", need)) for s in steps)
    short = [s["step"] for s in steps if int(s.get("groups", need)) < need]
    return {
        "generated_per_trained": round(decided / trained, 2) if trained else None,
        "generated": decided,
        "train_batch_groups": need,
        "generation_budget": budget,
        "short_steps": len(short),
    }


def sampling_line(summary: dict[str, Any]) -> str:
    """The dynamic-sampling line of the summary."""
    ratio = summary["generated_per_trained"]
    if ratio is None:  # nothing trained: a ratio would divide by zero
        return f"dynamic sampling: {summary.get('generated', 0)} groups generated, none trained"
    line = f"dynamic sampling: {ratio:.2f} groups generated per trained"
    if summary["generation_budget"] is None:
        return line + " (no generation budget: every batch refilled until full)"
    return line + (
        f"; {summary['short_steps']} steps trained short batches after "
        f"{summary['generation_budget']:g} × {summary['train_batch_groups']} groups generated "
        "(learner.generation_budget)"
    )


def accounting_lines(ledger: dict[str, Any]) -> list[str]:
    """Why groups were rejected, and the prompts skipped when the data was loaded."""
    lines = []
    if rejected := ledger.get("rejected"):
        reasons = ", ".join(f"{r} {n}" for r, n in sorted(rejected.items()))
        lines.append(f"rejected groups (refused for good, not retried): {reasons}")
    if data := ledger.get("dataset"):
        skipped = ", ".join(f"{r} {n}" for r, n in sorted(data["filtered"].items())) or "none"
        used = f"prompts: {data['rows']} rows, {data['usable']} used"
        lines.append(f"{used}; skipped at load: {skipped}")
    return lines


def staleness_line(report: dict[str, Any]) -> str:
    """Stale groups dropped (past the hard bound) and trained with the correction."""
    ledger, steps = report["ledger"], report["steps"]
    beyond = sum(int(s.get("beyond_soft", 0)) for s in steps)
    lag = max((int(s.get("policy_lag_max", 0)) for s in steps), default=0)
    mismatch = [s["engine_mismatch"] for s in steps if s.get("mismatch_tokens")]
    mean = f"{sum(mismatch) / len(mismatch):.2e}" if mismatch else "n/a (no token compared)"
    informative = ledger.get("kept", 0) + ledger.get("filtered", {}).get("stale", 0)
    rate = (
        f"{100 * ledger.get('stale_drop_rate', 0.0):.2f}%"
        if informative
        else "of none: no informative group yet"
    )
    return (
        f"staleness: {ledger.get('stale_dropped', 0)} informative groups dropped past the hard "
        f"bound ({rate}), {beyond} trained past the "
        f"soft bound; policy lag up to {lag}; engine mismatch {mean} (mean |Δ log-prob|)"
    )


def save_report(report: dict[str, Any], run_dir: Path) -> Path:
    path = run_dir / "report.json"
    path.write_text(json.dumps(report, indent=2))
    return path
