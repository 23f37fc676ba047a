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
    python: str | None = Field(
        None,
        description="Interpreter `dapo up` starts this role with, e.g. a virtual environment "
        "holding vLLM (as a deployment runs each role from its own image); None = the "
        "launcher's own.",
    )


class RpcConfig(StrictModel):
    """What every gRPC server and client agrees on: message limits, deadlines, retries."""

    max_message_bytes: int = Field(
        64 * 1024 * 1024,
        ge=1024,
        description="Largest gRPC message any service accepts or sends (and the largest "
        "weight-socket frame).",
    )
    max_score_items: int = Field(
        4096, ge=1, description="Most items in one Score request (the controller splits)."
    )

    score_timeout_s: float = Field(60.0, gt=0, description="Deadline of one Score call.")
    weights_timeout_s: float = Field(
        600.0, gt=0, description="Deadline of one FetchWeights call (the whole model)."
    )
    control_timeout_s: float = Field(
        10.0, gt=0, description="Deadline of small calls (GetVersion, GetStatus)."
    )
    backoff_base_s: float = Field(0.1, gt=0, description="First retry waits up to this.")
    backoff_cap_s: float = Field(5.0, gt=0, description="No retry waits longer than this.")
