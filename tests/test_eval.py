"""`dapo eval`: the pass@k estimator and a real end-to-end evaluation of the tiny model."""

from __future__ import annotations

import importlib.util
import itertools
import json
import signal
from pathlib import Path

import pytest
from dapo_cli import dapo, run_eval

from services.common.eval_stats import curve_point, pass_at_k, summarise
from services.tools.config import load_config
from services.tools.launcher import launch


def test_pass_at_k_matches_the_definition() -> None:
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 4) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2)
    assert pass_at_k(10, 3, 8) == 1.0  # fewer wrong than k: always hit


@pytest.mark.parametrize("n", [1, 2, 5, 7])
def test_pass_at_k_is_the_unbiased_estimator(n: int) -> None:
    """pass@k = the chance that k of the n samples, drawn without replacement, hold a
    correct one: counted over every k-subset of a row with c correct samples."""
    for c in range(n + 1):
        row = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(row, k))
            assert pass_at_k(n, c, k) == pytest.approx(sum(map(any, subsets)) / len(subsets))


def test_pass_at_k_hand_values_and_bad_arguments() -> None:
    assert pass_at_k(32, 8, 1) == pytest.approx(0.25)  # pass@1 = c / n
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)  # 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert pass_at_k(16, 1, 4) == pytest.approx(0.25)  # one hit among 16: k/n
    assert pass_at_k(6, 3, 3) == pytest.approx(0.95)  # 1 - C(3,3)/C(6,3) = 1 - 1/20
    for n, c, k in ((4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)):
        with pytest.raises(ValueError):
            pass_at_k(n, c, k)


def test_curve_point_adds_length_and_truncation() -> None:
    point = curve_point(
        [[True, False], [True, True]], [[3, 4], [1, 4]], [[False, True], [False, True]], 2
    )
    assert point["avg@2"] == 0.75 and point["pass@2"] == 1.0
    assert point["response_length"] == 3.0 and point["truncation_rate"] == 0.5


def test_summary_averages_over_samples_and_prompts() -> None:
    s = summarise([[True, False], [False, False]], 2)
    assert s["avg@2"] == 0.25 and s["pass@2"] == 0.5 and s["samples"] == 4


def test_eval_runs_end_to_end(tmp_path: Path, tiny_model: Path) -> None:
    options = ["--n", "4", "--max-tokens", "4", "--limit", "20"]
    data = run_eval(tiny_model, "synthetic:max3", tmp_path / "eval.json", *options)
    assert data["prompts"] == 20 and data["samples"] == 80
    assert 0.0 <= data["avg@4"] <= data["pass@4"] <= 1.0
    assert len(data["per_prompt"]) == 20


def test_eval_on_a_missing_model_is_one_clear_line(tmp_path: Path) -> None:
    result = dapo("eval", "--model", str(tmp_path / "nope"), "--data", "synthetic:max3", timeout=60)
    assert result.returncode == 2 and "model directory not found" in result.stderr
    assert "Traceback" not in result.stderr


def test_engine_options_are_validated_by_the_engine_config() -> None:
    from rollout.config import TorchEngineConfig, VllmEngineConfig
    from services.common.errors import DapoError
    from services.tools.evaluate import engine_config

    config = engine_config("vllm", ["kv_cache_memory_bytes=67108864", "enforce_eager=true"])
    assert config == VllmEngineConfig(kv_cache_memory_bytes=64 << 20, enforce_eager=True)
    assert engine_config("torch") == TorchEngineConfig()
    for bad in (["nope=1"], ["kv_cache_memory_bytes=-1"], ["enforce_eager"]):
        with pytest.raises(DapoError):
            engine_config("vllm", bad)


def test_in_run_eval_uses_the_rollout_servers_vllm_settings() -> None:
    from rollout.config import VllmEngineConfig
    from services.tools.config import load_config
    from services.tools.evaluate import eval_engine_config

    base = ["controller.eval.engine=vllm"]
    assert eval_engine_config(load_config(env={}, overrides=base)) == VllmEngineConfig()
    with_rollout = load_config(
        env={}, overrides=[*base, "rollout.engine.kind=vllm", "rollout.engine.max_model_len=32768"]
    )
    assert eval_engine_config(with_rollout) == VllmEngineConfig(max_model_len=32768)
    assert eval_engine_config(load_config(env={}, overrides=[])) is None


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm installed")
def test_eval_on_vllm_without_vllm_is_one_clear_line(tiny_model: Path) -> None:
    args = ["--model", str(tiny_model), "--data", "synthetic:max3", "--max-tokens", "8"]
    result = dapo("eval", *args, "--engine", "vllm", timeout=60)
    assert result.returncode == 2 and "vllm is not installed" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_eval_after_reads_the_final_export_when_the_learner_is_gone(
    tmp_path: Path, tiny_model: Path
) -> None:
    """With learner.linger_s=0 no learner is left to serve the final weights: the
    after-run evaluation loads the learner's final export and reports its version. The
    initial model's evaluation, run after training too, is exactly what evaluating the
    untouched model directory gives (the same seed): as if it had run before the start."""
    run_dir = tmp_path / "run"
    config = load_config(
        preset="tiny",
        overrides=[
            f"shared.model_path={tiny_model}",
            "learner.linger_s=0",
            "controller.eval.every_steps=0",
            "controller.eval.limit=8",
            "controller.eval.n=2",
        ],
    )
    handler = signal.getsignal(signal.SIGTERM)
    assert launch(config, run_dir=str(run_dir), steps=3) == 0
    assert signal.getsignal(signal.SIGTERM) is handler  # launch puts the caller's back
    report = json.loads((run_dir / "report.json").read_text())
    before, after = report["eval_before"], report["eval_after"]
    assert (before["version"], after["version"]) == (0, 3)
    assert after["prompts"] == 8 and after["samples"] == 16
    assert (run_dir / "checkpoints" / "final" / "config.json").is_file()
    from services.tools.evaluate import eval_plan, run_eval_plan

    plan = eval_plan(config)
    assert plan is not None
    again = run_eval_plan(plan, config, fetch_final=False)
    assert {k: v for k, v in again.items() if k != "seconds"} == {
        k: v for k, v in before.items() if k != "seconds"
    }
