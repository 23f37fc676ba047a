"""Configuration of the dynamic-sampling buffer (torch-free)."""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import Field, model_validator

from services.common.server_config import ServerConfig, StrictModel
from services.common.settings import RoleSettings

log = logging.getLogger(__name__)
RETIRED = ("history_size",)  # pass rates are recorded at publish (services/common/atomic.py)


class BufferConfig(StrictModel):
    """Which groups are informative enough to train on."""

    server: ServerConfig = Field(default_factory=lambda: ServerConfig(http_port=8005))
    keep_metric: Literal["acc", "reward"] = Field(
        "acc", description="Keep a group iff this metric varies within it (std > 0)."
    )
    dynamic_sampling: bool = Field(True, description="Off = forward every group (naive GRPO).")
    read_count: int = Field(64, ge=1, description="Entries read from `scored` per call.")
    rate_window: int = Field(200, ge=1, description="Recent groups the kept ratio is over.")
    low_rate_warning: float = Field(
        0.05, ge=0, le=1, description="Warn when the recent kept ratio falls below this."
    )
    stream_retain: int = Field(
        1000,
        ge=0,
        description="Acked entries kept at the tail of `scored` and `train` for inspection; "
        "older acked entries are deleted, so the streams stay bounded.",
    )
    trim_interval_s: float = Field(1.0, ge=0, description="Least seconds between two trims.")

    @model_validator(mode="before")
    @classmethod
    def _drop_retired(cls, data: Any) -> Any:
        """Old files that set a retired key still load, with one warning a key."""
        if not isinstance(data, dict):
            return data
        for key in [k for k in RETIRED if k in data]:
            log.warning("config: buffer.%s is no longer used (ignored)", key)
        return {k: v for k, v in data.items() if k not in RETIRED}


class BufferSettings(RoleSettings):
    """The buffer's process: shared, security and its own section."""

    buffer: BufferConfig = Field(default_factory=BufferConfig)
