"""Cross-field checks: the schema refuses what the config alone shows to be wrong;
`services/tools/checks.py` what needs the model directory or the machine (`dapo up` and
`dapo config show` run them before anything starts)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from dapo_cli import dapo

from reward.config import RewardSettings
from reward.shaping import overlong_penalty
from services.common.config_loader import ConfigError, load_settings
from services.tools import checks
from services.tools.config import load_config

ROOT = Path(__file__).resolve().parent.parent


def test_overlong_buffer_as_long_as_the_response_is_refused() -> None:
    # What the issue measured: every response of such a run is punished, even the shortest.
    assert overlong_penalty(1, 100, 400, 1.0) < 0
    for length in ("2048", "4096"):  # below and equal to the default buffer of 4096
        with pytest.raises(
            ConfigError,
            match=r"shared\.overlong_buffer_length \(4096\).*"
            rf"shared\.max_response_length \({length}\)",
        ):
            load_config(env={}, overrides=[f"shared.max_response_length={length}"])
    # The reward service alone refuses it too: it is the one that would apply the penalty.
    with pytest.raises(ConfigError, match="overlong_buffer_length"):
        load_settings(RewardSettings, env={}, overrides=["shared.max_response_length=2048"])
    # Without the punishment the buffer means nothing; a buffer inside the response is fine.
    load_config(
        env={}, overrides=["shared.max_response_length=2048", "reward.overlong_punishment=false"]
    )
    load_config(
        env={}, overrides=["shared.max_response_length=2048", "shared.overlong_buffer_length=512"]
    )


def test_the_message_is_one_clean_line() -> None:
    result = dapo("config", "show", "--set", "shared.max_response_length=2048")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and "Value error" not in result.stderr
    assert result.stderr.startswith("dapo config: error: invalid config: shared.overlong_buffer")


def test_vllm_context_must_hold_prompt_and_response() -> None:
    vllm = [
        "rollout.engine.kind=vllm",
        "shared.max_prompt_length=1024",
        "shared.max_response_length=3072",
        "shared.overlong_buffer_length=512",
    ]
    with pytest.raises(ConfigError, match=r"max_model_len \(4000\).*\(4096\)"):
        load_config(env={}, overrides=[*vllm, "rollout.engine.max_model_len=4000"])
    load_config(env={}, overrides=[*vllm, "rollout.engine.max_model_len=4096"])


def test_lengths_past_the_models_positions_stop_dapo_up_before_anything_starts(
    tiny_model: Path, tmp_path: Path
) -> None:
    assert checks.model_positions(tiny_model) == 256
    result = dapo(
        "up",
        "--preset",
        "tiny",
        "--run-dir",
        str(tmp_path / "run"),
        "--set",
        f"shared.model_path={tiny_model}",
        "--set",
        "shared.max_response_length=250",
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr
    assert "(16 + 250 = 266) exceeds the 256 positions" in lines[0]
    assert not (tmp_path / "run" / "logs").exists()  # no service was started


def test_file_dataset_without_eval_data_warns() -> None:
    config = load_config(env={}, overrides=["controller.dataset.path=/data/x.parquet"])
    assert "controller.eval.data is not set" in (checks.eval_data_warning(config) or "")
    quiet = ["controller.eval.enabled=false"], ["controller.eval.data=/data/aime.parquet"]
    for extra in quiet:
        config = load_config(env={}, overrides=["controller.dataset.path=/d.parquet", *extra])
        assert checks.eval_data_warning(config) is None
    result = dapo("config", "show", "--set", "controller.dataset.path=/data/x.parquet")
    assert result.returncode == 0 and "warning: no held-out evaluation" in result.stderr


def test_torch_eval_of_a_large_model_warns(tiny_model: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    parameters = checks.model_parameters(tiny_model)
    assert parameters == sum(p.numel() for p in model.parameters())  # tied counted once
    config = load_config(preset="tiny", env={})
    assert checks.torch_eval_warning(config, parameters) is None  # far below the threshold
    big = checks.TORCH_EVAL_MAX_PARAMS + 1
    assert "controller.eval.engine=vllm" in (checks.torch_eval_warning(config, big) or "")
    config.controller.eval.engine = "vllm"
    assert checks.torch_eval_warning(config, big) is None


def test_a_rollout_model_with_another_tokenizer_stops_dapo_up(
    tmp_path: Path, tiny_model: Path
) -> None:
    """One model path decides every role's tokenizer: the controller renders prompts with
    shared.model_path's, so a rollout.model_path whose tokenizer differs is refused."""
    import shutil

    same = Path(shutil.copytree(tiny_model, tmp_path / "same"))
    other = Path(shutil.copytree(tiny_model, tmp_path / "other"))
    (other / "chat_template.jinja").write_text(
        "{% for m in messages %}+{{ m['content'] }}{% endfor %}"
    )
    overrides = [f"shared.model_path={tiny_model}"]
    config = load_config(
        preset="tiny", env={}, overrides=[*overrides, f"rollout.model_path={same}"]
    )
    assert checks.tokenizer_problem(config) is None
    config = load_config(
        preset="tiny", env={}, overrides=[*overrides, f"rollout.model_path={other}"]
    )
    problem = checks.tokenizer_problem(config) or ""
    assert problem.startswith(f"the tokenizer of rollout.model_path {other} (")
    assert "one model path must decide every role's tokenizer" in problem
    assert problem in checks.check_run(config).errors


def test_tensor_parallelism_needs_the_gpus_a_server_gets() -> None:
    config = load_config(ROOT / "examples" / "dapo-qwen2.5-32b.yaml", env={})
    problem = checks.tensor_parallel_problem(config, 1, "in a pod")
    assert problem and "tensor_parallel_size is 4" in problem and "gets 1 GPU;" in problem
    assert checks.tensor_parallel_problem(config, 4, "in a pod") is None
    torch_engine = load_config(preset="tiny", env={})
    assert checks.tensor_parallel_problem(torch_engine, 1, "in a pod") is None


@pytest.mark.parametrize("example", sorted((ROOT / "examples").glob("*.yaml")), ids=str)
def test_every_example_validates_without_warnings(example: Path) -> None:
    found = checks.check_run(load_config(example, env={}))
    assert found.errors == [] and found.warnings == []


def test_paper_example_evaluates_aime_with_vllm() -> None:
    from services.controller.dataset import eval_data_spec

    config = load_config(ROOT / "examples" / "dapo-qwen2.5-32b.yaml", env={})
    cfg = config.controller.eval
    assert cfg.enabled and cfg.engine == "vllm" and cfg.n == 32 and cfg.top_p == 0.7
    assert eval_data_spec(cfg, config.controller.dataset) == "/data/aime-2024.parquet"


def rollout_pod(objects: list[dict]) -> tuple[int, str]:
    """(GPUs one rollout container gets, the ConfigMap's run.yaml) of rendered manifests."""
    from deploy_tools import by_key

    found = by_key(objects)
    container = found[("StatefulSet", "rollout")]["spec"]["template"]["spec"]["containers"][0]
    gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
    return gpus, found[("ConfigMap", "dapo-run-config")]["data"]["run.yaml"]


def test_k8s_rollout_pods_get_the_gpus_their_run_config_shards_over(tmp_path: Path) -> None:
    from deploy_tools import kustomize

    k8s = ROOT / "deploy" / "k8s"
    for target in [k8s / "base", *sorted((k8s / "overlays").iterdir())]:
        gpus, run_yaml = rollout_pod(kustomize(target))
        (tmp_path / "run.yaml").write_text(run_yaml)
        config = load_config(tmp_path / "run.yaml", env={})
        assert checks.tensor_parallel_problem(config, gpus, "pod") is None, target


def test_the_documented_overlay_fits_the_paper_example(tmp_path: Path) -> None:
    """docs/deploy.md's patch gives the 32B example's rollout pods their 4 GPUs."""
    import re

    import yaml
    from deploy_tools import kustomize

    doc = (ROOT / "docs" / "deploy.md").read_text()
    section = doc.split("### Tensor parallelism")[1]
    patches = yaml.safe_load(re.search(r"```yaml\n(.*?)```", section, re.S).group(1))
    base = os.path.relpath(ROOT / "deploy" / "k8s" / "base", tmp_path)  # kubectl: no absolute
    overlay = {"resources": [base], **patches}
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(overlay))
    gpus, _ = rollout_pod(kustomize(tmp_path))
    example = load_config(ROOT / "examples" / "dapo-qwen2.5-32b.yaml", env={})
    assert gpus == example.rollout.engine.tensor_parallel_size == 4
    assert checks.tensor_parallel_problem(example, gpus, "pod") is None
