"""`dapo bench NAME`: run benchmarks/NAME.py, which writes benchmarks/results/NAME.json."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

from services.common.errors import DapoError

ROOT = Path(__file__).resolve().parents[2]  # services/tools/bench.py -> the repository
BENCH_DIR = ROOT / "benchmarks"


def list_benchmarks() -> list[str]:
    """The names `dapo bench NAME` takes (benchmarks/_*.py are their helpers)."""
    return sorted(p.stem for p in BENCH_DIR.glob("*.py") if not p.stem.startswith("_"))


def run_benchmark(name: str, argv: list[str] | None = None) -> int:
    """Import benchmarks/NAME.py, call its main(argv), print its checks; 1 if any fails."""
    path = BENCH_DIR / f"{name}.py"
    if not path.is_file():
        available = list_benchmarks()
        raise DapoError(f"no benchmark {name!r}; available: {', '.join(available) or 'none'}")
    if str(ROOT) not in sys.path:  # benchmarks import their helpers as `benchmarks._x`
        sys.path.insert(0, str(ROOT))
    module = importlib.import_module(f"benchmarks.{name}")
    module.main(list(argv or []))
    result_path = BENCH_DIR / "results" / f"{name}.json"
    if not result_path.is_file():
        raise DapoError(f"benchmark {name} wrote no {result_path}")
    checks = json.loads(result_path.read_text()).get("checks", [])
    for check in checks:
        mark = "ok " if check["ok"] else "MISS"
        print(f"{mark} {check['name']}: {check['value']} (target {check['target']})")
    print(f"results: {result_path}")
    return 0 if all(c["ok"] for c in checks) else 1
