"""`dapo eval`: the pass@k estimator and a real end-to-end evaluation of the tiny model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from services.tools.evaluate import pass_at_k, summarise


def test_pass_at_k_matches_the_definition() -> None:
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 4) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2)
    assert pass_at_k(10, 3, 8) == 1.0  # fewer wrong than k: always hit


def test_summary_averages_over_samples_and_prompts() -> None:
    s = summarise([[True, False], [False, False]], 2)
    assert s["avg@2"] == 0.25 and s["pass@2"] == 0.5 and s["samples"] == 4


def test_eval_runs_end_to_end(tmp_path: Path, tiny_model: Path) -> None:
    out = tmp_path / "eval.json"
    result = subprocess.run(
        [sys.executable, "-m", "services.tools.cli", "eval", "--model", str(tiny_model),
         "--data", "synthetic:max3", "--n", "4", "--max-tokens", "4", "--limit", "20",
         "--verifier", "first_integer", "--no-chat-template", "--out", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["prompts"] == 20 and data["samples"] == 80
    assert 0.0 <= data["avg@4"] <= data["pass@4"] <= 1.0
    assert len(data["per_prompt"]) == 20


def test_eval_on_a_missing_model_is_one_clear_line(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "services.tools.cli", "eval", "--model", str(tmp_path / "nope"),
         "--data", "synthetic:max3"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2 and "model directory not found" in result.stderr
    assert "Traceback" not in result.stderr
