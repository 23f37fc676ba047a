"""The composition root: a whole run's configuration, every role's settings at once.

`DapoConfig` is `ControllerSettings`, `RolloutSettings`, `RewardSettings`,
`BufferSettings` and `LearnerSettings` in one model, so any role can be handed it; unlike a
role alone it refuses a mistake in any section.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import ConfigDict, Field

from learner.config import LearnerConfig, LearnerSettings
from reward.config import RewardConfig, RewardSettings
from rollout.config import RolloutConfig, RolloutSettings
from services.buffer.config import BufferConfig, BufferSettings
from services.common.config_loader import build_settings, dump_settings, load_settings
from services.common.security import SecurityConfig
from services.common.settings import SharedConfig
from services.controller.config import ControllerConfig, ControllerSettings


class DapoConfig(
    ControllerSettings, RolloutSettings, RewardSettings, BufferSettings, LearnerSettings
):
    """Everything a run needs; each role reads `shared`, `security` and its own section."""

    model_config = ConfigDict(extra="forbid")

    shared: SharedConfig = Field(default_factory=SharedConfig)
    controller: ControllerConfig = Field(default_factory=ControllerConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    buffer: BufferConfig = Field(default_factory=BufferConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    security: SecurityConfig = Field(default_factory=SecurityConfig)


def build_config(data: Mapping[str, Any]) -> DapoConfig:
    """Validate a merged dict into a DapoConfig, or raise ConfigError naming the field."""
    return build_settings(DapoConfig, data)


def load_config(
    path: str | Path | None = None,
    *,
    preset: str | None = None,
    overrides: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> DapoConfig:
    """Resolve the whole run's config from preset, file, environment and overrides."""
    return load_settings(DapoConfig, path, preset=preset, overrides=overrides, env=env)


def dump_config(config: DapoConfig, fmt: str = "yaml") -> str:
    """The resolved config as YAML (default) or JSON; secrets and URL passwords masked."""
    return dump_settings(config, fmt)
