"""Fuzzing the config loader: random YAML/TOML files, environments and --set overrides.

Whatever comes in, `load_config` returns a config that survives a dump/reload round
trip, or raises ConfigError with one non-empty line; never another exception.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Any

import yaml
from fuzzing import fuzz
from hypothesis import strategies as st
from pydantic import BaseModel

from services.common.config_loader import ConfigError
from services.tools.config import DapoConfig, dump_config, load_config


def field_paths(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every section.field[.subfield] of the config, nested models included."""
    paths = []
    for name, info in model.model_fields.items():
        path = (*prefix, name)
        paths.append(path)
        kind = info.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            paths.extend(field_paths(kind, path))
    return paths


PATHS = field_paths(DapoConfig)
KEY_PATHS = st.one_of(
    st.sampled_from(PATHS),
    st.lists(st.text(min_size=0, max_size=6), min_size=1, max_size=3).map(tuple),
)
SCALAR_TEXTS = st.one_of(
    st.sampled_from(
        [
            "0",
            "1",
            "-1",
            "2",
            "8",
            "0.5",
            "1e-5",
            "1e400",
            "nan",
            ".nan",
            ".inf",
            "-.inf",
            "true",
            "null",
            "~",
            "[]",
            "[1, 2]",
            "{a: 1}",
            "2024-01-01",
            "'x'",
            "vllm",
            "torch",
            "!!python/object:os.system",
            "&a [*a]",
            "{",
            "]",
            "0x10",
            "1_000",
            "--",
            "",
        ]
    ),
    st.text(max_size=10),
)
VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.text(max_size=8),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)


def nest(path: tuple[str, ...], value: Any) -> dict[str, Any]:
    out: Any = value
    for key in reversed(path):
        out = {key: out}
    return out


@st.composite
def yaml_files(draw: st.DrawFn) -> bytes:
    """A YAML document of known or unknown fields, or arbitrary text/bytes."""
    kind = draw(st.integers(0, 3))
    if kind == 0:
        return draw(st.binary(max_size=40))
    if kind == 1:
        return draw(st.text(max_size=40)).encode("utf-8", "surrogatepass")
    data: dict[str, Any] = {}
    for path, value in draw(st.lists(st.tuples(KEY_PATHS, VALUES), max_size=4)):
        data = {**data, **nest(path, value)}
    return yaml.safe_dump(data, allow_unicode=True).encode("utf-8", "surrogatepass")


@st.composite
def toml_files(draw: st.DrawFn) -> bytes:
    """`[section]` tables with `key = value` lines, values as TOML literals or junk."""
    lines = []
    for path in draw(st.lists(KEY_PATHS, max_size=4)):
        value = draw(st.sampled_from(["1", "-3", "0.5", "nan", "inf", "true", '"x"', "[1]", "{}"]))
        head, key = path[:-1], path[-1]
        lines += [f"[{'.'.join(head)}]" if head else "", f"{key} = {value}"]
    if draw(st.booleans()):
        lines.append(draw(st.text(max_size=10)))
    return "\n".join(lines).encode("utf-8", "surrogatepass")


ENVS = st.dictionaries(
    st.one_of(
        KEY_PATHS.map(lambda p: "DAPO_" + "__".join(p).upper()),
        st.text(max_size=12).map(lambda s: "DAPO_" + s),
    ),
    SCALAR_TEXTS,
    max_size=3,
)
OVERRIDES = st.lists(
    st.one_of(
        st.tuples(KEY_PATHS, SCALAR_TEXTS).map(lambda kv: ".".join(kv[0]) + "=" + kv[1]),
        st.text(max_size=12),
    ),
    max_size=3,
)


def check_load(path: Path | None, env: dict[str, str], overrides: list[str]) -> None:
    try:
        config = load_config(path, env=env, overrides=overrides)
    except ConfigError as exc:
        message = str(exc)
        assert message.strip() and "\n" not in message and "\r" not in message, repr(message)
        return
    assert all(math.isfinite(x) for x in _floats(config.model_dump())), config
    with tempfile.TemporaryDirectory() as tmp:  # deleted again: 1000s of cases per run
        dumped = Path(tmp) / "dumped.yaml"
        dumped.write_text(dump_config(config))
        again = load_config(overrides=[], env={}, path=dumped)
    # Dumps mask secrets (token, Redis password, URL passwords), so the reloaded config is
    # compared through its dump: every other field must survive the round trip.
    assert dump_config(again) == dump_config(config)


def _floats(value: Any) -> list[float]:
    if isinstance(value, dict):
        return [x for v in value.values() for x in _floats(v)]
    if isinstance(value, list):
        return [x for v in value for x in _floats(v)]
    return [value] if isinstance(value, float) else []


def test_fuzz_config_sources() -> None:
    with tempfile.TemporaryDirectory() as tmp:

        def check(
            suffix: str | None, yaml_text: bytes, toml_text: bytes, env: dict, overrides: list
        ) -> None:
            path = None
            if suffix is not None:
                path = Path(tmp) / f"c{suffix}"
                path.write_bytes(toml_text if suffix == ".toml" else yaml_text)
            check_load(path, env, overrides)

        fuzz(
            check,
            suffix=st.sampled_from([".yaml", ".toml", None]),
            yaml_text=yaml_files(),
            toml_text=toml_files(),
            env=ENVS,
            overrides=OVERRIDES,
        )


def test_fuzz_one_override_per_known_field() -> None:
    """One `--set` on a real field: mostly a valid config, so bad values cannot hide
    behind an unrelated error (this is the case that found infinite lr accepted)."""

    def check(path: tuple[str, ...], value: str, via_env: bool) -> None:
        if via_env:
            check_load(None, {"DAPO_" + "__".join(path).upper(): value}, [])
        else:
            check_load(None, {}, [".".join(path) + "=" + value])

    fuzz(check, path=st.sampled_from(PATHS), value=SCALAR_TEXTS, via_env=st.booleans())
