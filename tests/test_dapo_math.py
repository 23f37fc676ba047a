"""DAPO-Math-17k's parquet layout: it loads through the AIME loader, evaluations count each
problem once however often the file repeats it, and `dapo eval` reports avg@k and pass@k
on it (torch engine here; vLLM in tests/test_eval_vllm.py)."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
from dapo_cli import run_eval
from dapo_math_data import SCHEMA, write_dapo_math

from services.common.data import load_records
from services.controller.dataset import load_eval_records


def test_the_generated_file_has_the_release_schema(tmp_path: Path) -> None:
    path = write_dapo_math(tmp_path / "dapo-math-17k.parquet", problems=3, copies=2)
    assert pq.read_schema(path).remove_metadata() == SCHEMA


def test_rows_load_through_the_aime_loader(tmp_path: Path) -> None:
    path = write_dapo_math(tmp_path / "dapo-math-17k.parquet", problems=5, copies=3)
    records = load_records(path)
    assert len(records) == 15
    first = records[0]
    assert (first.data_source, first.ability, first.reward_style) == (
        "math_dapo",
        "MATH",
        "rule-lighteval/MATH_v2",
    )
    assert first.messages == [{"role": "user", "content": first.prompt}]
    assert first.prompt_id == f"math_dapo-{first.index}" and len(str(first.index)) == 36
    assert first.raw_problem == "" and first.split is None  # not in the 17k release
    # the same problem five rows later: same index, prompt and answer
    assert (records[5].prompt_id, records[5].ground_truth) == (first.prompt_id, first.ground_truth)
    assert load_records(path, unique=True) == records[:5]


@pytest.mark.parametrize("same_index", [True, False])
def test_evaluations_count_each_problem_once(tmp_path: Path, same_index: bool) -> None:
    path = write_dapo_math(tmp_path / "d.parquet", problems=6, copies=4, same_index=same_index)
    records = load_eval_records(str(path))
    assert len(records) == 6 and len({r.prompt for r in records}) == 6
    assert [r.prompt for r in records] == [r.prompt for r in load_records(path)[:6]]
    assert len(load_eval_records(str(path), limit=2)) == 2


def test_dapo_eval_reports_avg_and_pass_at_k_on_it(tmp_path: Path, tiny_model: Path) -> None:
    data = write_dapo_math(tmp_path / "dapo-math-17k.parquet", problems=12, copies=3)
    options = ["--n", "4", "--max-tokens", "4", "--engine", "torch"]
    data_out = run_eval(tiny_model, data, tmp_path / "eval.json", *options)
    assert (data_out["prompts"], data_out["samples"], data_out["engine"]) == (12, 48, "torch")
    assert 0.0 <= data_out["avg@4"] <= data_out["pass@4"] <= 1.0
    rows = data_out["per_prompt"]
    assert len({r["prompt_id"] for r in rows}) == 12
    # avg@4 is the mean of the per-problem accuracies (4 samples each)
    assert data_out["avg@4"] == pytest.approx(sum(r["accuracy"] for r in rows) / 12)
    # with n = k, pass@k is the share of problems with at least one correct sample
    assert data_out["pass@4"] == pytest.approx(sum(r["accuracy"] > 0 for r in rows) / 12)
