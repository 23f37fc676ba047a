"""`dapo eval` on the vLLM engine (`make test-vllm`): avg@k with n = k per prompt, the
same numbers as the torch engine where both are deterministic (greedy decoding)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from dapo_cli import run_eval
from dapo_math_data import write_dapo_math
from vllm_support import needs_vllm, own_tmpdir

from rollout.config import VllmEngineConfig
from services.common.data import synthetic_records
from services.tools.evaluate import evaluate

ENGINE = VllmEngineConfig(
    dtype="float32", enforce_eager=True, max_model_len=256, kv_cache_memory_bytes=64 << 20
)


@pytest.fixture(scope="module")
def small_model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    from learner.init_model import init_model

    with own_tmpdir(tmp_path_factory.mktemp("vllm-tmp")):
        yield init_model(tmp_path_factory.mktemp("small-model"), preset="small", seed=0)


@pytest.mark.vllm
@needs_vllm
def test_eval_on_vllm_samples_k_per_prompt_and_agrees_with_torch(small_model: Path) -> None:
    records = synthetic_records("max3", split="test")[:6]
    k = 3
    args = (records, k, 8, 0.0, 1.0, "first_integer", False)  # n, max_tokens, T, top_p, ...
    on_vllm = evaluate(small_model, *args, engine_config=ENGINE)
    on_torch = evaluate(small_model, *args)
    assert (on_vllm["engine"], on_torch["engine"]) == ("vllm", "torch")
    assert (on_vllm["prompts"], on_vllm["samples"]) == (6, 6 * k)
    assert on_vllm[f"avg@{k}"] == on_torch[f"avg@{k}"]
    # greedy: the same responses from both engines (the first 200 characters of each)
    assert [p["example"] for p in on_vllm["per_prompt"]] == [
        p["example"] for p in on_torch["per_prompt"]
    ]


@pytest.mark.vllm
@needs_vllm
def test_dapo_eval_on_vllm_reads_the_dapo_math_17k_layout(
    small_model: Path, tmp_path: Path
) -> None:
    """`dapo eval --engine vllm` on a file in DAPO-Math-17k's schema: each problem once
    (the file repeats them), k samples each, pass@k from the unbiased estimator. vLLM's
    processes inherit the module's TMPDIR (`own_tmpdir`)."""
    data = write_dapo_math(tmp_path / "dapo-math-17k.parquet", problems=5, copies=3)
    options = [
        f"--engine-option={k}={v}"
        for k, v in (
            ("dtype", "float32"),
            ("enforce_eager", "true"),
            ("max_model_len", "256"),
            ("kv_cache_memory_bytes", str(64 << 20)),
        )
    ]
    args = ["--n", "3", "--max-tokens", "8", "--engine", "vllm", *options]
    data_out = run_eval(small_model, data, tmp_path / "eval.json", *args, timeout=600)
    assert (data_out["engine"], data_out["prompts"], data_out["samples"]) == ("vllm", 5, 15)
    rows = data_out["per_prompt"]
    assert data_out["avg@3"] == pytest.approx(sum(r["accuracy"] for r in rows) / 5)
    assert data_out["pass@3"] == pytest.approx(sum(r["accuracy"] > 0 for r in rows) / 5)
