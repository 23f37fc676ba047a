"""The settings every role reads: the shared section, security, and the base of a role's
settings (torch-free).

What two roles must agree on (group size, lengths, sampling, verifier, model, Redis, RPC
limits, the registry's lifetime, the batch size admission aims at) lives here, once. Each
role's own section is defined in its package and composed by `<Role>Settings`; the whole
run's `DapoConfig` (services/tools/config.py) is every role's settings at once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator

from services.common.security import SecurityConfig
from services.common.server_config import RpcConfig, StrictModel

# Every top-level section a config file may hold; a role validates its own and these names.
SECTIONS = ("shared", "controller", "rollout", "reward", "buffer", "learner", "security")

HARD_BOUND_FACTOR = 4

VerifierName = Literal["dapo", "math_verify", "cascade", "first_integer"]


class SamplingConfig(StrictModel):
    """Training-time sampling (paper: temperature 1.0, top-p 1.0); the learner divides
    its logits by the same temperature."""

    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, description="-1 = no top-k truncation.")


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
        0,
        ge=0,
        description="Soft bound: policy versions generation may run ahead, what admission "
        "paces for (0 = on-policy).",
    )
    max_staleness_hard: int | None = Field(
        None,
        ge=0,
        description="Hard bound: groups up to this many versions behind are still trained "
        "(with the learner's off-policy correction); older ones are dropped and counted. "
        "None = 4 x max_staleness (0 stays synchronous).",
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
    model_init: Literal["tiny", "tiny_long", "tiny_vllm", "small"] | None = Field(
        None, description="`dapo up` builds a random model of this preset if model_path is absent."
    )
    redis_appendonly: bool = Field(
        True,
        description="The redis-server `dapo up` starts logs every write (AOF) and is "
        "restarted from that log if it dies; off = a dead Redis loses the run's state.",
    )
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    verifier: Literal["default", "dapo", "math_verify", "cascade", "first_integer"] = Field(
        "default", description="Verifier asked of the reward service; default = its own."
    )
    train_batch_groups: int = Field(
        512, ge=1, description="Informative groups per training step (admission aims at it)."
    )
    registry_ttl_s: float = Field(
        5.0, gt=0, description="Registry entry lifetime; a dead server vanishes after it."
    )
    rpc: RpcConfig = Field(default_factory=RpcConfig)
    when_done: Literal["exit", "idle"] = Field(
        "exit",
        description="What a service does once the run is done: exit 0 (dapo up, compose), or "
        "release everything and keep answering /healthz and /readyz until SIGTERM (a "
        "Kubernetes Deployment or StatefulSet, which would restart an exited pod).",
    )

    @property
    def staleness_hard_bound(self) -> int:
        """`max_staleness_hard` as an int: `_resolve_hard_bound` has replaced None."""
        if self.max_staleness_hard is None:  # only model_construct() skips the validator
            raise ValueError("shared.max_staleness_hard was never resolved (unvalidated config)")
        return self.max_staleness_hard

    @model_validator(mode="after")
    def _resolve_hard_bound(self) -> SharedConfig:
        """None becomes HARD_BOUND_FACTOR x the soft bound: the one place that default lives
        (decoupled PPO held accuracy to staleness 4-8 in AReaL)."""
        if self.max_staleness_hard is None:
            self.max_staleness_hard = HARD_BOUND_FACTOR * self.max_staleness
        if self.max_staleness_hard < self.max_staleness:
            raise ValueError("shared.max_staleness_hard must be >= shared.max_staleness")
        return self


class RoleSettings(StrictModel):
    """What one role's process is configured with: `shared`, `security` and (in a
    subclass) its own section. Other roles' sections in the same file are not its
    business and are ignored; `DapoConfig` validates them all."""

    model_config = ConfigDict(extra="ignore")

    shared: SharedConfig = Field(default_factory=SharedConfig)
    security: SecurityConfig = Field(default_factory=SecurityConfig)

    @classmethod
    def upgrade_layer(cls, data: Mapping[str, Any]) -> dict[str, Any]:
        """One config layer (preset, file, environment, overrides) with renamed keys in their
        new place (ValueError on a key given both ways). Layer by layer, so an old key in a
        later layer still overrides the new one in an earlier layer. No renames here."""
        return dict(data)
