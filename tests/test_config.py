"""Configuration: defaults are the paper's, every layer overrides, errors name the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from learner.config import LEGACY_KEYS, LearnerConfig
from services.common.config_loader import ConfigError
from services.common.presets import PRESETS
from services.tools.config import DapoConfig, dump_config, load_config

ROOT = Path(__file__).resolve().parent.parent


def test_defaults_are_the_papers_hyperparameters() -> None:
    c = load_config(env={})
    assert (c.learner.objective.clip_ratio_low, c.learner.objective.clip_ratio_high) == (0.2, 0.28)
    assert (
        c.learner.optimizer.lr == 1e-6
        and c.learner.optimizer.weight_decay == 0.1
        and c.learner.optimizer.grad_clip == 1.0
    )
    assert c.learner.optimizer.warmup_steps == 20 and c.learner.objective.kl_coef == 0.0
    assert c.learner.objective.loss_agg_mode == "token_mean"
    assert c.shared.group_size == 16 and c.shared.train_batch_groups == 512
    batch = c.shared.train_batch_groups * c.shared.group_size
    assert batch // c.learner.batching.mini_batch_responses == 16  # 16 gradient updates per step
    assert c.shared.max_response_length == 20480 and c.shared.overlong_buffer_length == 4096
    assert c.shared.max_prompt_length == 2048
    assert c.shared.sampling.temperature == 1.0 and c.shared.sampling.top_p == 1.0
    assert c.buffer.dynamic_sampling and c.learner.objective.overlong_filtering


def test_layers_override_in_order(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        "learner:\n  optimizer:\n    lr: 0.5\n  total_steps: 7\nshared:\n  group_size: 4\n"
    )
    env = {"DAPO_LEARNER__OPTIMIZER__LR": "0.25", "DAPO_ROLLOUT__ENGINE__DTYPE": "bfloat16"}
    c = load_config(path, preset="tiny", overrides=["shared.group_size=8"], env=env)
    assert c.learner.total_steps == 7  # file over preset
    assert c.learner.optimizer.lr == 0.25  # env over file
    assert c.shared.group_size == 8  # CLI over file
    assert c.rollout.engine.dtype == "bfloat16"  # nested env
    assert c.shared.run_name == "tiny"  # preset kept where nothing overrides


def test_toml_files_load(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[shared]\nrun_name = "t"\n[rollout.engine]\nkind = "vllm"\n')
    c = load_config(path, env={})
    assert c.shared.run_name == "t" and c.rollout.engine.kind == "vllm"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"overrides": ["learner.objective.clip_ratio_high=-1"]},
            "learner.objective.clip_ratio_high",
        ),
        ({"overrides": ["shared.group_size=1"]}, "shared.group_size"),
        (
            {"overrides": ["learner.objective.clip_ratio_low=1"]},
            "learner.objective.clip_ratio_low",
        ),
        ({"overrides": ["learner.nope=1"]}, "learner.nope"),
        ({"overrides": ["rollout.engine.kind=tpu"]}, "rollout.engine"),
        ({"overrides": ["no-equals-sign"]}, "section.field=value"),
        ({"preset": "huge"}, "unknown preset 'huge'"),
        ({"path": "/does/not/exist.yaml"}, "config file not found"),
    ],
)
def test_invalid_values_name_the_field(kwargs: dict, message: str) -> None:
    path = kwargs.pop("path", None)
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        load_config(path, env={}, **kwargs)


def test_malformed_file_is_one_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("learner: [unclosed\n")
    with pytest.raises(ConfigError, match="cannot parse"):
        load_config(path, env={})
    path.write_text("- a list\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(path, env={})


def test_dump_round_trips() -> None:
    c = load_config(preset="tiny", env={})
    assert DapoConfig.model_validate(yaml.safe_load(dump_config(c))) == c


@pytest.mark.parametrize(
    ("example", "preset"),
    [("tiny-cpu", "tiny"), ("tiny-runmax-cpu", "tiny_runmax"), ("long-cpu", "long")],
)
def test_cpu_examples_equal_their_presets(example: str, preset: str) -> None:
    assert load_config(ROOT / "examples" / f"{example}.yaml", env={}) == load_config(
        preset=preset, env={}
    )


def test_paper_example_keeps_the_paper_hyperparameters() -> None:
    paper = load_config(ROOT / "examples" / "dapo-qwen2.5-32b.yaml", env={})
    defaults = load_config(env={})
    for section, name in (
        ("learner.objective", "clip_ratio_low"),
        ("learner.objective", "clip_ratio_high"),
        ("learner.optimizer", "lr"),
        ("shared", "group_size"),
        ("shared", "max_response_length"),
        ("shared", "overlong_buffer_length"),
        ("shared", "train_batch_groups"),
    ):
        want = defaults.model_dump()
        got = paper.model_dump()
        for part in section.split("."):
            want, got = want[part], got[part]
        assert got[name] == want[name], f"{section}.{name}"


def test_every_preset_validates() -> None:
    for name in PRESETS:
        load_config(preset=name, env={})


# An old file's learner section, before it was nested: every flat key, none at its default.
FLAT_LEARNER = {
    "clip_ratio_low": 0.1,
    "clip_ratio_high": 0.3,
    "clip_ratio_c": 5.0,
    "logratio_clamp": 10.0,
    "loss_agg_mode": "seq_mean_token_mean",
    "norm_adv_by_std": False,
    "adv_epsilon": 1e-5,
    "overlong_filtering": False,
    "correction": {"kind": "mis", "high": 3.0},
    "kl_coef": 0.01,
    "lr": 2e-5,
    "warmup_steps": 3,
    "weight_decay": 0.2,
    "betas": [0.8, 0.9],
    "grad_clip": 0.5,
    "mini_batch_responses": 7,
    "micro_batch_tokens": 999,
    "packing": False,
    "logprob_chunk_tokens": 64,
    "gradient_checkpointing": False,
    "zero_stage": 3,
    "cpu_shm_allreduce": True,
    "checkpoint_dir": "/ck",
    "checkpoint_every": 9,
    "resume": True,
    "export_dir": "/ex",
    "weight_bucket_bytes": 2048,
    "gather_bucket_bytes": 4096,
    "publish_in_background": False,
    "weight_transport": "grpc",
    "weight_socket_port": 5555,
    "total_steps": 11,
}
# The same section as written today.
NESTED_LEARNER = {
    "total_steps": 11,
    "objective": {
        "clip_ratio_low": 0.1,
        "clip_ratio_high": 0.3,
        "clip_ratio_c": 5.0,
        "logratio_clamp": 10.0,
        "loss_agg_mode": "seq_mean_token_mean",
        "norm_adv_by_std": False,
        "adv_epsilon": 1e-5,
        "overlong_filtering": False,
        "correction": {"kind": "mis", "high": 3.0},
        "kl_coef": 0.01,
    },
    "optimizer": {
        "lr": 2e-5,
        "warmup_steps": 3,
        "weight_decay": 0.2,
        "betas": [0.8, 0.9],
        "grad_clip": 0.5,
    },
    "batching": {
        "mini_batch_responses": 7,
        "micro_batch_tokens": 999,
        "packing": False,
        "logprob_chunk_tokens": 64,
        "gradient_checkpointing": False,
    },
    "deepspeed": {"zero_stage": 3, "cpu_shm_allreduce": True},
    "checkpoint": {"dir": "/ck", "every": 9, "resume": True, "export_dir": "/ex"},
    "publication": {
        "bucket_bytes": 2048,
        "gather_bucket_bytes": 4096,
        "in_background": False,
        "transport": "grpc",
        "socket_port": 5555,
    },
}


def _write(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def test_an_old_flat_learner_section_loads_as_the_nested_one(tmp_path: Path) -> None:
    assert set(FLAT_LEARNER) - {"total_steps"} == set(LEGACY_KEYS)  # every old key covered
    old = load_config(_write(tmp_path / "old.yaml", {"learner": FLAT_LEARNER}), env={})
    new = load_config(_write(tmp_path / "new.yaml", {"learner": NESTED_LEARNER}), env={})
    assert old == new
    assert new.learner.checkpoint.dir == "/ck" and new.learner.publication.transport == "grpc"
    assert new.learner.optimizer.betas == (0.8, 0.9) and new.learner.deepspeed.zero_stage == 3
    # In Python too (a dict of the old shape, as an old script builds it).
    assert LearnerConfig.model_validate(FLAT_LEARNER) == LearnerConfig.model_validate(
        NESTED_LEARNER
    )


def test_old_keys_in_overrides_and_the_environment_still_override(tmp_path: Path) -> None:
    """Each layer is upgraded alone: an old key in a later layer beats the nested key of an
    earlier one (the presets are nested)."""
    c = load_config(preset="tiny", overrides=["learner.lr=0.5"], env={})
    assert (
        c.learner.optimizer.lr == 0.5
        and load_config(preset="tiny", env={}).learner.optimizer.lr == 5e-4
    )
    env = {"DAPO_LEARNER__CHECKPOINT_DIR": "/env", "DAPO_LEARNER__ZERO_STAGE": "1"}
    c = load_config(_write(tmp_path / "new.yaml", {"learner": NESTED_LEARNER}), env=env)
    assert c.learner.checkpoint.dir == "/env" and c.learner.deepspeed.zero_stage == 1
    old = _write(tmp_path / "old.yaml", {"learner": FLAT_LEARNER})
    c = load_config(old, overrides=["learner.optimizer.lr=0.25"], env={})
    assert c.learner.optimizer.lr == 0.25  # a new key over an old file


@pytest.mark.parametrize(
    ("kwargs", "source"),
    [
        ({"overrides": ["learner.resume=true", "learner.checkpoint.resume=false"]}, "--set"),
        (
            {"env": {"DAPO_LEARNER__RESUME": "1", "DAPO_LEARNER__CHECKPOINT__RESUME": "0"}},
            "environment",
        ),
        ({"path": {"learner": {"resume": True, "checkpoint": {"resume": False}}}}, "both.yaml"),
    ],
)
def test_a_key_given_both_ways_is_refused(kwargs: dict, source: str, tmp_path: Path) -> None:
    if "path" in kwargs:
        kwargs["path"] = _write(tmp_path / "both.yaml", kwargs["path"])
    kwargs.setdefault("env", {})
    with pytest.raises(ConfigError) as raised:
        load_config(**kwargs)
    message = str(raised.value)
    assert "learner.resume and learner.checkpoint.resume both given" in message
    assert source in message and "\n" not in message


def test_a_key_given_both_ways_is_refused_in_python() -> None:
    with pytest.raises(ValidationError, match="learner.lr and learner.optimizer.lr both given"):
        LearnerConfig.model_validate({"lr": 1e-3, "optimizer": {"lr": 1e-4}})


def test_a_retired_buffer_key_still_loads_with_a_warning(caplog) -> None:
    """buffer.history_size went with the buffer's pass rates (now recorded at publish)."""
    from services.buffer.config import BufferConfig

    with caplog.at_level("WARNING"):
        config = BufferConfig.model_validate({"history_size": 8, "read_count": 32})
    assert config.read_count == 32
    assert "buffer.history_size is no longer used" in caplog.text
