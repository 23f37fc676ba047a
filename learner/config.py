"""Configuration of the learner: the DAPO objective and the optimiser (torch-free)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from services.common.server_config import ServerConfig, StrictModel
from services.common.settings import RoleSettings

LossAggMode = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]


class NoCorrection(StrictModel):
    """Plain DAPO: the ratio is taken against the learner's recomputed π_old only."""

    kind: Literal["none"] = "none"


class TokenTIS(StrictModel):
    """Token-level truncated IS: w_t = min(π_prox / π_behav, cap)."""

    kind: Literal["token_tis"] = "token_tis"
    cap: float = Field(2.0, gt=0, description="Upper bound of each token's weight.")


class SequenceTIS(StrictModel):
    """Sequence-level truncated IS: every token of a response weighs min(Π_t ρ_t, cap)."""

    kind: Literal["seq_tis"] = "seq_tis"
    cap: float = Field(2.0, gt=0, description="Upper bound of each sequence's weight.")


class MaskedIS(StrictModel):
    """Masked IS: weight ρ inside [low, high]; tokens (or whole sequences) outside get no loss."""

    kind: Literal["mis"] = "mis"
    level: Literal["token", "sequence"] = "token"
    low: float = Field(0.5, ge=0, le=1, description="Smallest kept weight.")
    high: float = Field(2.0, ge=1, description="Largest kept weight.")


class TwoSidedMask(StrictModel):
    """IcePop-style two-sided masking: tokens with ρ outside [low, high] get no loss, the
    others weigh 1 (rejection only, no reweighting)."""

    kind: Literal["mask"] = "mask"
    low: float = Field(0.5, ge=0, le=1, description="Smallest kept ratio.")
    high: float = Field(5.0, ge=1, description="Largest kept ratio.")


Correction = Annotated[
    NoCorrection | TokenTIS | SequenceTIS | MaskedIS | TwoSidedMask, Field(discriminator="kind")
]
DEFAULT_CORRECTION = TokenTIS()


class LearnerLaunch(StrictModel):
    """How `dapo learner` starts its data-parallel ranks on this machine (learner/launch.py)."""

    ranks: int = Field(
        1,
        ge=1,
        description="Ranks on this machine; > 1: `dapo learner` re-executes itself under "
        "torchrun (--standalone), one process per rank (learner.engine must be deepspeed).",
    )
    max_restarts: int = Field(
        3,
        ge=0,
        description="torchrun restarts of the whole rank group after any rank dies; each "
        "restart resumes from the last checkpoint.",
    )
    shutdown_timeout_s: int = Field(
        120,
        ge=1,
        description="Seconds torchrun waits after SIGTERM before it SIGKILLs the ranks: the "
        "step in progress plus a checkpoint must fit (a pod's grace period must exceed it).",
    )


class LearnerConfig(StrictModel):
    """Defaults are the paper's (DAPO.md, Qwen2.5-32B); presets and files override them."""

    server: ServerConfig = Field(
        default_factory=lambda: ServerConfig(grpc_port=50053, http_port=8003)
    )
    model_path: str | None = Field(None, description="Local Hugging Face model directory.")
    # -- the objective --
    clip_ratio_low: float = Field(0.2, ge=0, description="epsilon_low.")
    clip_ratio_high: float = Field(0.28, ge=0, description="epsilon_high (clip-higher).")
    clip_ratio_c: float | None = Field(
        None, gt=1, description="Dual-clip bound for negative advantages (recipe: 10.0)."
    )
    logratio_clamp: float = Field(20.0, gt=0, description="Clamp |log ratio| before exp.")
    loss_agg_mode: LossAggMode = Field("token_mean", description="DAPO token-level loss.")
    norm_adv_by_std: bool = Field(True, description="Divide advantages by the group std.")
    adv_epsilon: float = Field(1e-6, ge=0)
    overlong_filtering: bool = Field(True, description="Mask truncated responses.")
    correction: Correction | None = Field(
        None,
        description="Off-policy correction against the engine's log-probs (π_prox / "
        "π_behav); None = token_tis (cap 2) when stale groups can be trained "
        "(shared staleness hard bound > 0), none otherwise.",
    )
    kl_coef: float = Field(0.0, ge=0, description="KL to a reference model (DAPO: none).")
    # -- the optimiser --
    lr: float = Field(1e-6, gt=0)
    warmup_steps: int = Field(20, ge=0, description="Linear warm-up, in rollout steps.")
    weight_decay: float = Field(0.1, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = Field(1.0, gt=0)
    # -- batching --
    mini_batch_responses: int = Field(
        512, ge=1, description="Responses per gradient update (paper: 16 updates per step)."
    )
    micro_batch_tokens: int = Field(32768, ge=1, description="Token budget of a micro-batch.")
    packing: bool = Field(
        True,
        description="Pack whole sequences into one row per micro-batch (no padding; "
        "position ids restart per sequence); off: rows padded to the longest.",
    )
    logprob_chunk_tokens: int = Field(
        512,
        ge=0,
        description="Response tokens whose full-vocabulary logits exist at once (forward "
        "and backward); 0: logits of every position of the micro-batch at once.",
    )
    gradient_checkpointing: bool = Field(
        True, description="Recompute decoder layers in backward instead of storing them."
    )
    total_steps: int = Field(1000, ge=1, description="Training steps before the run ends.")
    generation_budget: float | None = Field(
        None,
        ge=1,
        description="Bounded dynamic sampling: a step waits for at most this many groups "
        "generated (decided by the buffer) per group of a full batch; past that it trains "
        "on the informative groups it holds (at least one), a short batch whose token-level "
        "loss stays exact, and says so (the metrics' `groups`, the progress bar, the "
        "summary). None: refill until the batch is full, as the paper; a departure from it "
        "otherwise (docs/architecture.md). The tiny and long presets use 4.",
    )
    # -- engine --
    engine: Literal["torch", "deepspeed"] = Field(
        "deepspeed", description="deepspeed (ZeRO, data parallel) or a plain torch loop."
    )
    zero_stage: int = Field(2, ge=0, le=3, description="DeepSpeed ZeRO stage.")
    dtype: Literal["float32", "bfloat16"] = Field(
        "bfloat16", description="Training dtype (DeepSpeed keeps fp32 master weights)."
    )
    cpu_shm_allreduce: bool = Field(
        False, description="DeepSpeed's shared-memory all-reduce on CPU (a ~1 min JIT build)."
    )
    checkpoint_dir: str | None = Field(
        None, description="Checkpoints go here; unset: none, and entries are acked every step."
    )
    checkpoint_every: int = Field(50, ge=1, description="Checkpoint every K steps (and on stop).")
    resume: bool = Field(False, description="Restore the latest checkpoint in checkpoint_dir.")
    export_dir: str | None = Field(
        None, description="Final save_pretrained model (default: <checkpoint_dir>/final)."
    )
    weight_bucket_bytes: int = Field(
        4 * 1024 * 1024,
        ge=1024,
        description="Weight bytes per gRPC message (4 MiB: docs/weight_publication.md).",
    )
    gather_bucket_bytes: int = Field(
        64 * 1024 * 1024,
        ge=1024,
        description="Under ZeRO-3, the most full-weight bytes gathered at once for publishing "
        "(one parameter larger than this is gathered alone): the whole model is never "
        "gathered on one rank.",
    )
    publish_in_background: bool = Field(
        True,
        description="Snapshot each version's weights in the step and hand the snapshot to "
        "the WeightService in a background thread while the next step trains (at most one "
        "publication in flight); false: publish inside the step.",
    )
    weight_transport: Literal["socket", "grpc"] = Field(
        "socket",
        description="How rollout servers pull weights: 'socket' (a ticket over gRPC, the "
        "bytes over a plain/TLS TCP socket, ~1.5x faster) or 'grpc' (FetchWeights stream).",
    )
    weight_socket_port: int = Field(
        0, ge=0, le=65535, description="TCP port of the weight socket (0: any free port)."
    )
    linger_s: float = Field(
        30.0, ge=0, description="After the last step, keep serving the final weights this long."
    )
    launch: LearnerLaunch = Field(default_factory=LearnerLaunch)

    @model_validator(mode="after")
    def _clip_order(self) -> LearnerConfig:
        if self.clip_ratio_low >= 1:
            raise ValueError("clip_ratio_low must be < 1")
        if self.launch.ranks > 1 and self.engine != "deepspeed":
            raise ValueError(
                f"learner.launch.ranks={self.launch.ranks} needs learner.engine=deepspeed "
                "(the torch engine trains in one process)"
            )
        return self


class LearnerSettings(RoleSettings):
    """The learner's process: shared, security and its own section."""

    learner: LearnerConfig = Field(default_factory=LearnerConfig)

    @model_validator(mode="after")
    def _resolve_correction(self) -> LearnerSettings:
        """None becomes token_tis when stale groups can be trained (hard bound > 0), else none."""
        if self.learner.correction is None:
            stale = self.shared.staleness_hard_bound > 0
            chosen = DEFAULT_CORRECTION if stale else NoCorrection()
            self.learner = self.learner.model_copy(update={"correction": chosen})
        return self

    @property
    def correction(self) -> Correction:
        """The correction in effect (`_resolve_correction` has replaced None)."""
        return self.learner.correction or NoCorrection()

    @property
    def model_path(self) -> str | None:
        """The policy's starting point: the learner's model dir, else the shared one."""
        return self.learner.model_path or self.shared.model_path
