"""The root configuration: one shared section plus one section per service.

Resolution order (later wins): built-in defaults (the paper's hyperparameters) → preset →
YAML/TOML file → environment (`DAPO_<SECTION>__<FIELD>[__<SUBFIELD>]=value`) → CLI
`--set section.field=value` overrides.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError

from learner.config import LearnerConfig
from reward.config import RewardConfig
from rollout.config import RolloutConfig
from services.buffer.config import BufferConfig
from services.common.errors import DapoError, describe_validation
from services.common.presets import PRESETS
from services.common.security import VERBATIM_FIELDS, SecurityConfig, redact_url
from services.common.server_config import RpcConfig, StrictModel
from services.controller.config import ControllerConfig

ENV_PREFIX = "DAPO_"


class SharedConfig(StrictModel):
    """Values several services must agree on; defined once here."""

    run_name: str = Field("dapo", min_length=1, description="Run id; namespaces Redis keys.")
    group_size: int = Field(16, ge=2, description="G: responses sampled per prompt.")
    max_prompt_length: int = Field(2048, ge=1, description="Prompt tokens; longer are refused.")
    max_response_length: int = Field(
        20480, ge=1, description="L_max: generation stops here (the response is truncated)."
    )
    overlong_buffer_length: int = Field(
        4096, ge=0, description="L_cache: soft punishment starts at L_max - L_cache."
    )
    overlong_penalty_factor: float = Field(1.0, ge=0, description="Scale of the soft penalty.")
    max_staleness: int = Field(
        0, ge=0, description="Policy versions generation may run ahead (0 = on-policy)."
    )
    seed: int = Field(0, ge=0)
    redis_url: str | None = Field(
        None, description="Redis to use; None = `dapo up` starts a local redis-server."
    )
    model_path: str | None = Field(
        None, description="Model directory for rollout and learner unless they set their own."
    )
    torch_threads: int | None = Field(
        None,
        ge=1,
        description="Intra-op threads of torch processes (None = torch's default); "
        "on a small CPU box several torch processes must not oversubscribe the cores.",
    )
    model_init: Literal["tiny", "small"] | None = Field(
        None, description="`dapo up` builds a random model of this preset if model_path is absent."
    )
    redis_appendonly: bool = Field(
        True,
        description="The redis-server `dapo up` starts logs every write (AOF) and is "
        "restarted from that log if it dies; off = a dead Redis loses the run's state.",
    )
    rpc: RpcConfig = Field(default_factory=RpcConfig)


class DapoConfig(StrictModel):
    """Everything a run needs; each service reads `shared` plus its own section."""

    shared: SharedConfig = Field(default_factory=SharedConfig)
    controller: ControllerConfig = Field(default_factory=ControllerConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    buffer: BufferConfig = Field(default_factory=BufferConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    security: SecurityConfig = Field(default_factory=SecurityConfig)

    @property
    def model_path(self) -> str | None:
        """The learner's model dir (the policy's starting point)."""
        return self.learner.model_path or self.shared.model_path


class ConfigError(DapoError):
    """The configuration is invalid; the message names the field."""


def deep_merge(base: dict[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """Recursively merge `update` into a copy of `base`."""
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def nested(path: Sequence[str], value: Any) -> dict[str, Any]:
    """`["a", "b"], 1` → `{"a": {"b": 1}}`."""
    out: Any = value
    for key in reversed(path):
        out = {key: out}
    return out


def parse_scalar(text: str) -> Any:
    """Parse a CLI/env value with YAML rules ("8" → 8, "true" → True, "null" → None)."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def read_file(path: Path) -> dict[str, Any]:
    """Load a YAML or TOML config file into a dict."""
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        text = path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    try:
        data = tomllib.loads(text) if path.suffix == ".toml" else yaml.safe_load(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot parse {path}: {str(exc).splitlines()[0]}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    return data


def env_overrides(env: Mapping[str, str]) -> dict[str, Any]:
    """`DAPO_LEARNER__LR=1e-5` → `{"learner": {"lr": 1e-05}}`."""
    out: dict[str, Any] = {}
    for key, value in env.items():
        if key.startswith(ENV_PREFIX) and "__" in key:
            path = key[len(ENV_PREFIX) :].lower().split("__")
            parsed = value if path[-1] in VERBATIM_FIELDS else parse_scalar(value)
            out = deep_merge(out, nested(path, parsed))
    return out


def cli_overrides(items: Sequence[str]) -> dict[str, Any]:
    """`["learner.lr=1e-5"]` → `{"learner": {"lr": 1e-05}}`."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like section.field=value")
        out = deep_merge(out, nested(key.strip().split("."), parse_scalar(value)))
    return out


def format_validation_error(exc: ValidationError) -> str:
    """One line naming each problem's dotted field (control characters escaped)."""
    return "invalid config: " + describe_validation(exc.errors(), "config", limit=None)


def build_config(data: Mapping[str, Any]) -> DapoConfig:
    """Validate a merged dict into a DapoConfig, or raise ConfigError naming the field."""
    try:
        return DapoConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from None


def load_config(
    path: str | Path | None = None,
    *,
    preset: str | None = None,
    overrides: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> DapoConfig:
    """Resolve a config from preset, file, environment and overrides (in that order)."""
    data: dict[str, Any] = {}
    if preset is not None:
        if preset not in PRESETS:
            raise ConfigError(f"unknown preset {preset!r}; choose one of: {', '.join(PRESETS)}")
        data = deep_merge(data, PRESETS[preset])
    if path is not None:
        data = deep_merge(data, read_file(Path(path)))
    data = deep_merge(data, env_overrides(os.environ if env is None else env))
    data = deep_merge(data, cli_overrides(overrides))
    return build_config(data)


def dump_config(config: DapoConfig, fmt: str = "yaml") -> str:
    """The resolved config as YAML (default) or JSON; secrets and URL passwords masked."""
    data = config.model_dump(mode="json")
    if data["shared"]["redis_url"]:
        data["shared"]["redis_url"] = redact_url(data["shared"]["redis_url"])
    if fmt == "json":
        import json

        return json.dumps(data, indent=2)
    return yaml.safe_dump(data, sort_keys=False)
