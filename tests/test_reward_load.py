"""benchmarks/reward_load.py, briefly: 4 clients for ~3 s of mixed, adversarial traffic."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_short_load_run_has_no_errors(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("reward_load", ROOT / "benchmarks/reward_load.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # as `dapo bench` loads it
    out = tmp_path / "reward_load.json"
    argv = ["--duration", "3", "--clients", "4", "--baseline-s", "1", "--out", str(out)]
    module.main(argv)
    result = json.loads(out.read_text())
    assert result["errors"] == 0, result["error_messages"]
    assert result["wrong_verdicts"] == 0
    assert result["requests"] > 0 and result["items"] == 4 * result["requests"]
    assert result["heavy_items"] >= 1  # the paced power tower went through and came back
    assert result["latency"]["http"]["p50_s"] > 0 and result["latency"]["grpc"]["p50_s"] > 0
