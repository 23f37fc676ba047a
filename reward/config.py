"""Configuration of the reward service (torch-free)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from services.common.server_config import ServerConfig, StrictModel
from services.common.settings import RoleSettings, VerifierName

StartMethod = Literal["forkserver", "spawn"]


class RewardConfig(StrictModel):
    """Verification and shaping. Overlong lengths come from the shared section."""

    server: ServerConfig = Field(
        default_factory=lambda: ServerConfig(grpc_port=50051, http_port=8001)
    )
    default_verifier: VerifierName = Field(
        "cascade", description="Verifier for items that do not name one."
    )
    num_workers: int | None = Field(
        None, ge=1, description="Verifier worker processes; None = the CPU count."
    )
    timeout_s: float = Field(
        5.0, gt=0, description="Hard per-item limit; a worker past it is killed and replaced."
    )
    overlong_punishment: bool = Field(
        True, description="Add the soft overlong punishment (reward/shaping.py) to the reward."
    )
    max_response_chars: int = Field(
        1_000_000, ge=1, description="Longest response accepted, in characters."
    )
    max_ground_truth_chars: int = Field(
        10_000, ge=1, description="Longest ground truth accepted, in characters."
    )
    max_request_bytes: int = Field(
        64 * 1024 * 1024,
        ge=1024,
        description="Largest HTTP request body (413 beyond); gRPC limits are "
        "shared.rpc.max_message_bytes.",
    )
    soft_timeout_s: int = Field(
        2,
        ge=0,
        description="math-verify's own SIGALRM limit per parse/verify call, whole seconds; "
        "cheaper than a kill. 0 = off: only the hard timeout_s bounds an item.",
    )
    inline_rules: bool = Field(
        True,
        description="Check the bounded rules (dapo, first_integer) on short text in the "
        "request's thread, not in a worker (reward/inline.py); false sends every item to "
        "the pool.",
    )
    start_method: StartMethod = Field(
        "forkserver",
        description="How workers start: forkserver (math-verify preloaded, fast replacement) "
        "or spawn (a fresh interpreter each).",
    )


class RewardSettings(RoleSettings):
    """The reward service's process: shared, security and its own section."""

    reward: RewardConfig = Field(default_factory=RewardConfig)

    @model_validator(mode="after")
    def _overlong_buffer_inside_the_response(self) -> RewardSettings:
        """The soft zone starts at L_max - L_cache: at or below 0 every response, a correct
        one-token answer included, is punished (users shrink L_max for small runs and keep
        the paper's 4096-token buffer)."""
        if self.reward.overlong_punishment:
            problem = overlong_buffer_problem(
                self.shared.max_response_length, self.shared.overlong_buffer_length
            )
            if problem is not None:
                raise ValueError(problem)
        return self


def overlong_buffer_problem(max_len: int, buffer_len: int) -> str | None:
    """Why an overlong buffer of `buffer_len` tokens cannot go with responses of `max_len`."""
    if buffer_len < max_len:
        return None
    return (
        f"shared.overlong_buffer_length ({buffer_len}) must be less than "
        f"shared.max_response_length ({max_len}): the soft overlong penalty would punish "
        f"every response; set it to a fraction of the response length (the paper: 4096 of "
        f"20480), to 0 for no soft zone, or reward.overlong_punishment=false"
    )
