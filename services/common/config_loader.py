"""Reading a run's configuration: preset, file, environment and overrides merged into one
dict, then validated by whichever settings model the caller needs (a role's, or the
whole run's `DapoConfig`).

Resolution order (later wins): built-in defaults (the paper's hyperparameters) → preset →
YAML/TOML file → environment (`DAPO_<SECTION>__<FIELD>[__<SUBFIELD>]=value`) → CLI
`--set section.field=value` overrides.
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from services.common.errors import DapoError, describe_validation, one_line
from services.common.presets import PRESETS
from services.common.security import VERBATIM_FIELDS, redact_url
from services.common.settings import SECTIONS, RoleSettings

M = TypeVar("M", bound=BaseModel)
S = TypeVar("S", bound=RoleSettings)

ENV_PREFIX = "DAPO_"


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
    out: dict[str, Any] = {path[-1]: value} if path else {}
    for key in reversed(path[:-1]):
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
    """`DAPO_LEARNER__OPTIMIZER__LR=1e-5` → `{"learner": {"optimizer": {"lr": 1e-05}}}`."""
    out: dict[str, Any] = {}
    for key, value in env.items():
        if key.startswith(ENV_PREFIX) and "__" in key:
            path = key[len(ENV_PREFIX) :].lower().split("__")
            parsed = value if path[-1] in VERBATIM_FIELDS else parse_scalar(value)
            out = deep_merge(out, nested(path, parsed))
    return out


def cli_overrides(items: Sequence[str]) -> dict[str, Any]:
    """`["learner.optimizer.lr=1e-5"]` → `{"learner": {"optimizer": {"lr": 1e-05}}}`."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like section.field=value")
        out = deep_merge(out, nested(key.strip().split("."), parse_scalar(value)))
    return out


def format_validation_error(exc: ValidationError) -> str:
    """One line naming each problem's dotted field (control characters escaped); a
    cross-field check names its fields in its own message."""
    field_errors = [{**e, "msg": cross_field_message(e)} for e in exc.errors() if e["loc"]]
    parts = [cross_field_message(e) for e in exc.errors() if not e["loc"]]
    if field_errors:
        parts.append(describe_validation(field_errors, "config", limit=None))
    return "invalid config: " + "; ".join(parts)


def cross_field_message(error: Any) -> str:
    """A validator's message without pydantic's "Value error, " prefix."""
    return one_line(str(error["msg"]).removeprefix("Value error, "))


def check_sections(data: Mapping[str, Any]) -> None:
    """Unknown top-level sections are typos; a role that ignores other roles' sections
    must still refuse them."""
    unknown = sorted(str(key) for key in data if key not in SECTIONS)
    if unknown:
        raise ConfigError(
            f"invalid config: unknown section {', '.join(map(repr, unknown))}; "
            f"sections are {', '.join(SECTIONS)}"
        )


def resolve_data(
    path: str | Path | None = None,
    *,
    preset: str | None = None,
    overrides: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    upgrade: Callable[[Mapping[str, Any]], dict[str, Any]] = RoleSettings.upgrade_layer,
) -> dict[str, Any]:
    """Merge preset, file, environment and overrides (in that order) into one dict, each
    layer `upgrade`d (renamed keys moved to their new place) before it is merged."""
    layers: list[tuple[str, Mapping[str, Any]]] = []
    if preset is not None:
        if preset not in PRESETS:
            raise ConfigError(f"unknown preset {preset!r}; choose one of: {', '.join(PRESETS)}")
        layers.append((f"preset {preset}", PRESETS[preset]))
    if path is not None:
        layers.append((str(path), read_file(Path(path))))
    layers.append(("environment", env_overrides(os.environ if env is None else env)))
    layers.append(("--set", cli_overrides(overrides)))
    data: dict[str, Any] = {}
    for source, layer in layers:
        try:
            data = deep_merge(data, upgrade(layer))
        except ValueError as exc:
            raise ConfigError(f"invalid config ({source}): {one_line(str(exc))}") from None
    return data


def build_settings(model: type[M], data: Mapping[str, Any]) -> M:
    """Validate a merged dict into `model`, or raise ConfigError naming the field."""
    check_sections(data)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from None


def load_settings(
    model: type[S],
    path: str | Path | None = None,
    *,
    preset: str | None = None,
    overrides: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> S:
    """Resolve a config from preset, file, environment and overrides into `model`."""
    data = resolve_data(
        path, preset=preset, overrides=overrides, env=env, upgrade=model.upgrade_layer
    )
    return build_settings(model, data)


def dump_settings(config: BaseModel, fmt: str = "yaml") -> str:
    """Settings as YAML (default) or JSON, sections in their documented order; secrets and
    URL passwords masked."""
    dumped = config.model_dump(mode="json")
    data = {name: dumped[name] for name in SECTIONS if name in dumped}
    shared = data.get("shared") or {}
    if shared.get("redis_url"):
        shared["redis_url"] = redact_url(shared["redis_url"])
    if fmt == "json":
        return json.dumps(data, indent=2)
    return str(yaml.safe_dump(data, sort_keys=False))
