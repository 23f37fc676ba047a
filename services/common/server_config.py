"""Network settings every service shares (a pydantic model; torch-free)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class StrictModel(BaseModel):
    """Base for every config model: unknown keys are errors, so typos never pass silently;
    NaN and infinity are refused (an infinite lr or timeout is never what was meant)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class ServerConfig(StrictModel):
    """Where a service listens. Port 0 picks a free port (printed at start-up)."""

    host: str = Field("127.0.0.1", description="Interface to bind; 0.0.0.0 in containers.")
    grpc_port: int = Field(0, ge=0, le=65535, description="gRPC port; 0 = pick a free one.")
    http_port: int = Field(0, ge=0, le=65535, description="HTTP port; 0 = pick a free one.")
    max_message_bytes: int = Field(
        64 * 1024 * 1024, ge=1024, description="Largest gRPC message accepted or sent."
    )
