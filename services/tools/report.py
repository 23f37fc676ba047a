"""What `dapo up` leaves behind: report.json, PNG curves, and a printed summary."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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


def write_plots(steps: list[dict[str, Any]], ratios: dict[int, float], out_dir: Path) -> list[Path]:
    """One PNG per curve (matplotlib's Agg backend; no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    series = {key: ([s["step"] for s in steps], [s[key] for s in steps]) for key, _ in
              [v for k, v in CURVES.items() if k != "kept_ratio"]}  # fmt: skip
    series["kept_ratio"] = (list(ratios), list(ratios.values()))
    written = []
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


def summary_lines(report: dict[str, Any]) -> list[str]:
    """The lines printed at the end of `dapo up`."""
    ledger = report["ledger"]
    lines = [
        f"run {report['run']}: {len(report['steps'])} steps in {report['wall_seconds']:.0f}s, "
        f"ledger {'holds' if ledger['ok'] else 'MISMATCH: ' + '; '.join(ledger['problems'])}",
        f"groups: admitted {ledger['admitted']}, trained {ledger['trained']}, "
        f"filtered {sum(ledger['filtered'].values())}, dropped {sum(ledger['dropped'].values())}",
    ]
    lines.append(staleness_line(report))
    before, after = report.get("eval_before"), report.get("eval_after")
    if before and after:
        key = next(k for k in before if k.startswith("avg@"))
        lines.append(f"held-out {key}: {before[key]:.3f} before → {after[key]:.3f} after "
                     f"(policy version {after.get('version')})")  # fmt: skip
    return lines


def staleness_line(report: dict[str, Any]) -> str:
    """Stale groups dropped (past the hard bound) and trained with the correction."""
    ledger, steps = report["ledger"], report["steps"]
    beyond = sum(int(s.get("beyond_soft", 0)) for s in steps)
    lag = max((int(s.get("policy_lag_max", 0)) for s in steps), default=0)
    mismatch = [s["engine_mismatch"] for s in steps if s.get("mismatch_tokens")]
    mean = f"{sum(mismatch) / len(mismatch):.2e}" if mismatch else "n/a"
    return (
        f"staleness: {ledger.get('stale_dropped', 0)} informative groups dropped past the hard "
        f"bound ({100 * ledger.get('stale_drop_rate', 0.0):.2f}%), {beyond} trained past the "
        f"soft bound; policy lag up to {lag}; engine mismatch {mean} (mean |Δ log-prob|)"
    )


def save_report(report: dict[str, Any], run_dir: Path) -> Path:
    path = run_dir / "report.json"
    path.write_text(json.dumps(report, indent=2))
    return path
