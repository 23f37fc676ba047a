"""The one shape of a benchmark's result: `checks` rows and the file `dapo bench` reads.

Every benchmark writes benchmarks/results/NAME.json with its details and
`checks: [{name, value, target, ok}]`; these helpers are the only place that shape is made.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"

Check = dict[str, Any]


def check(name: str, value: Any, target: Any, ok: bool, digits: int = 3) -> Check:
    """One `checks` row; a float value is rounded to `digits` places for reading."""
    shown = round(value, digits) if isinstance(value, float) else value
    return {"name": name, "value": shown, "target": target, "ok": bool(ok)}


def at_least(name: str, value: float, target: float, digits: int = 3) -> Check:
    """A row that passes when the (unrounded) value reaches a numeric target."""
    return check(name, value, target, value >= target, digits)


def at_most(name: str, value: float, target: float, digits: int = 3) -> Check:
    """A row that passes when the (unrounded) value stays within a numeric ceiling."""
    return check(name, value, target, value <= target, digits)


def machine(load_start: tuple[float, float, float]) -> dict[str, Any]:
    """Where the numbers were measured: platform, Python, cores, and the load average at the
    start (`os.getloadavg()` taken then) and now. (`os.uname`, not `platform.platform()`,
    which runs `uname -p` in a subprocess.)"""
    system = os.uname()
    return {
        "platform": f"{system.sysname}-{system.release}-{system.machine}",
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_average_start": [round(x, 2) for x in load_start],
        "load_average_end": [round(x, 2) for x in os.getloadavg()],
    }


def result_path(name: str) -> Path:
    """Where benchmark NAME writes its result (what `dapo bench NAME` reads back)."""
    return RESULTS_DIR / f"{name}.json"


def all_ok(checks: list[Check]) -> bool:
    return all(row["ok"] for row in checks)


def write_result(path: Path, result: dict[str, Any]) -> int:
    """Write `result` (details + `checks`) as indented JSON; 0 if every check is ok, else 1."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if all_ok(result.get("checks", [])) else 1
