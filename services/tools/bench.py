"""`dapo bench NAME`: run benchmarks/NAME.py, which writes benchmarks/results/NAME.json.

A benchmark runs `REPEATS` times (its module's, else `DEFAULT_REPEATS`; `--repeats N`
overrides), each once the load average is below `--load-below` (at most `SETTLE_S` of
waiting) when given, and writes one result: the last run's details, every run's checks
and load before it, and each check row holding only if it held in N of N runs (its
`value` then lists the N values, `held` says in how many it held, `spread` their min
and max). A figure that holds once can be luck on a shared 2-core machine.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from services.common.errors import DapoError

ROOT = Path(__file__).resolve().parents[2]  # services/tools/bench.py -> the repository
BENCH_DIR = ROOT / "benchmarks"
SETTLE_S = 90.0
DEFAULT_REPEATS = 3


def list_benchmarks() -> list[str]:
    """The names `dapo bench NAME` takes (benchmarks/_*.py are their helpers)."""
    return sorted(p.stem for p in BENCH_DIR.glob("*.py") if not p.stem.startswith("_"))


def load() -> float:
    """The 1-minute load average, rounded for the record."""
    return round(os.getloadavg()[0], 2)


def settle(below: float, most_s: float = SETTLE_S) -> float:
    """The load average once it fell below `below` (waiting at most `most_s`): a run
    starts on a quiet machine, not in the previous run's tail (the average decays over a
    minute after a run ends)."""
    deadline = time.monotonic() + most_s
    while load() >= below and time.monotonic() < deadline:
        time.sleep(2)
    return load()


def run_benchmark(
    name: str,
    argv: list[str] | None = None,
    repeats: int | None = None,
    load_below: float | None = None,
) -> int:
    """Import benchmarks/NAME.py, call its main(argv) `repeats` times (None: its own
    REPEATS), print the checks; 1 if any fails (in any run)."""
    path = BENCH_DIR / f"{name}.py"
    if not path.is_file():
        available = list_benchmarks()
        raise DapoError(f"no benchmark {name!r}; available: {', '.join(available) or 'none'}")
    if repeats is not None and repeats < 1:
        raise DapoError(f"--repeats must be at least 1, not {repeats}")
    if str(ROOT) not in sys.path:  # benchmarks import their helpers as `benchmarks._x`
        sys.path.insert(0, str(ROOT))
    module = importlib.import_module(f"benchmarks.{name}")
    own: int = getattr(module, "REPEATS", DEFAULT_REPEATS)  # probe-ok: optional per benchmark
    runs_wanted = repeats or own
    result_path = BENCH_DIR / "results" / f"{name}.json"
    runs = []
    for _ in range(runs_wanted):
        before = load() if load_below is None else settle(load_below)
        written = written_at(result_path)
        module.main(list(argv or []))
        if written_at(result_path) in (None, written):  # not the last run's file read again
            raise DapoError(f"benchmark {name} wrote no {result_path}")
        runs.append({**json.loads(result_path.read_text()), "load_before": before})
    result = runs[-1]
    if runs_wanted > 1:
        result = merge_repeats(runs, load_below)
        result_path.write_text(json.dumps(result, indent=2) + "\n")
    checks = result.get("checks", [])
    for check in checks:
        mark = "ok " if check["ok"] else "MISS"
        held = f", held {check['held']}" if "held" in check else ""
        print(f"{mark} {check['name']}: {check['value']} (target {check['target']}{held})")
    print(f"results: {result_path}")
    return 0 if all(c["ok"] for c in checks) else 1


def written_at(path: Path) -> int | None:
    """When `path` was last written (None: it does not exist)."""
    return path.stat().st_mtime_ns if path.is_file() else None


def merge_repeats(runs: list[dict[str, Any]], load_below: float | None) -> dict[str, Any]:
    """One result from N runs: a check holds only if it held in every run."""
    by_name: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        for row in run.get("checks", []):
            by_name.setdefault(row["name"], []).append(row)
    checks = [merged_row(rows, len(runs)) for rows in by_name.values()]
    return {
        **{k: v for k, v in runs[-1].items() if k not in ("checks", "load_before")},
        "repeats": {
            "n": len(runs),
            "load_below": load_below,
            "load_before": [run["load_before"] for run in runs],
            "checks": [run.get("checks", []) for run in runs],
        },
        "checks": checks,
    }


def merged_row(rows: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """A check over N runs: every value, ok in N of N (a run without the row fails it)."""
    values = [row["value"] for row in rows]
    held = sum(bool(row["ok"]) for row in rows)
    merged = {
        "name": rows[0]["name"],
        "value": values,
        "target": rows[0]["target"],
        "ok": held == n,
        "held": f"{held} of {n}",
    }
    if all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        merged["spread"] = [min(values), max(values)]
    return merged
