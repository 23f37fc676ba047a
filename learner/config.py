"""Configuration of the learner (torch-free), nested by job: the DAPO objective, the
optimiser, batching, DeepSpeed, checkpoints and weight publication."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, model_validator

from services.common.server_config import ServerConfig, StrictModel
from services.common.settings import RoleSettings

log = logging.getLogger(__name__)

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


class ObjectiveConfig(StrictModel):
    """The DAPO loss: clipping, advantages, masking, off-policy correction and KL."""

    clip_ratio_low: float = Field(0.2, ge=0, lt=1, description="epsilon_low.")
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
    old_logprobs: Literal["recompute", "auto"] = Field(
        "auto",
        description="π_old: 'recompute' scores every response with the learner's weights "
        "each step; 'auto' uses the engine's log-probs instead when every token was sampled "
        "by the version being trained and the last measured engine/learner gap (max |Δ log "
        "p|, re-measured every 10 steps) is within old_logprobs_max_gap.",
    )
    old_logprobs_max_gap: float = Field(
        1e-4, gt=0, description="Largest per-token |log π_engine − log π_learner| for 'auto'."
    )


class OptimizerConfig(StrictModel):
    """AdamW and its schedule."""

    lr: float = Field(1e-6, gt=0)
    warmup_steps: int = Field(20, ge=0, description="Linear warm-up, in rollout steps.")
    weight_decay: float = Field(0.1, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = Field(1.0, gt=0)


class BatchingConfig(StrictModel):
    """How a step's responses become gradient updates and micro-batches."""

    mini_batch_responses: int = Field(
        512, ge=1, description="Responses per gradient update (paper: 16 updates per step)."
    )
    micro_batch_tokens: int = Field(32768, ge=1, description="Token budget of a micro-batch.")
    packing: bool | Literal["auto"] = Field(
        True,
        description="Pack whole sequences into one row per micro-batch (no padding; "
        "position ids restart per sequence); off: rows padded to the longest; auto: pack "
        "when padding would cost more than packing's overhead (learner.batch_plan.packs).",
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


class DeepSpeedConfig(StrictModel):
    """DeepSpeed's settings (learner.engine=deepspeed)."""

    zero_stage: int = Field(2, ge=0, le=3, description="DeepSpeed ZeRO stage.")
    cpu_shm_allreduce: bool = Field(
        False, description="DeepSpeed's shared-memory all-reduce on CPU (a ~1 min JIT build)."
    )


class CheckpointConfig(StrictModel):
    """Checkpoints, resuming, and the final exported model."""

    dir: str | None = Field(
        None, description="Checkpoints go here; unset: none, and entries are acked every step."
    )
    every: int = Field(50, ge=1, description="Checkpoint every K steps (and on stop).")
    resume: bool = Field(False, description="Restore the latest checkpoint in `dir`.")
    async_write: bool = Field(
        True,
        description="Write periodic checkpoints in the background while the next steps "
        "train (the state copied to host memory first; `latest` moves once every rank's "
        "files are written, so a crash meanwhile loses one period more). false: each "
        "step that checkpoints waits for the write. The stop's is always waited for.",
    )
    export_dir: str | None = Field(
        None, description="Final save_pretrained model (default: <dir>/final)."
    )


class PublicationConfig(StrictModel):
    """Publishing each policy version's weights to the rollout servers."""

    bucket_bytes: int = Field(
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
    in_background: bool = Field(
        True,
        description="Snapshot each version's weights in the step and hand the snapshot to "
        "the WeightService in a background thread while the next step trains (at most one "
        "publication in flight); false: publish inside the step.",
    )
    transport: Literal["socket", "grpc"] = Field(
        "socket",
        description="How rollout servers pull weights: 'socket' (a ticket over gRPC, the "
        "bytes over a plain/TLS TCP socket, ~1.5x faster) or 'grpc' (FetchWeights stream).",
    )
    socket_port: int = Field(
        0, ge=0, le=65535, description="TCP port of the weight socket (0: any free port)."
    )


# Flat keys of the learner section before it was nested: old key → (sub-model, new key).
LEGACY_KEYS: dict[str, tuple[str, str]] = {
    **{
        key: ("objective", key)
        for key in (
            "clip_ratio_low",
            "clip_ratio_high",
            "clip_ratio_c",
            "logratio_clamp",
            "loss_agg_mode",
            "norm_adv_by_std",
            "adv_epsilon",
            "overlong_filtering",
            "correction",
            "kl_coef",
        )
    },
    **{
        key: ("optimizer", key)
        for key in ("lr", "warmup_steps", "weight_decay", "betas", "grad_clip")
    },
    **{
        key: ("batching", key)
        for key in (
            "mini_batch_responses",
            "micro_batch_tokens",
            "packing",
            "logprob_chunk_tokens",
            "gradient_checkpointing",
        )
    },
    "zero_stage": ("deepspeed", "zero_stage"),
    "cpu_shm_allreduce": ("deepspeed", "cpu_shm_allreduce"),
    "checkpoint_dir": ("checkpoint", "dir"),
    "checkpoint_every": ("checkpoint", "every"),
    "resume": ("checkpoint", "resume"),
    "export_dir": ("checkpoint", "export_dir"),
    "weight_bucket_bytes": ("publication", "bucket_bytes"),
    "gather_bucket_bytes": ("publication", "gather_bucket_bytes"),
    "publish_in_background": ("publication", "in_background"),
    "weight_transport": ("publication", "transport"),
    "weight_socket_port": ("publication", "socket_port"),
}
_warned: set[str] = set()


def move_legacy_keys(section: Mapping[str, Any]) -> dict[str, Any]:
    """The learner section with each old flat key moved to its sub-model, warned once per
    process; a key given both ways is refused (ValueError naming both)."""
    out = dict(section)
    for old in [key for key in out if key in LEGACY_KEYS]:
        group, new = LEGACY_KEYS[old]
        sub = out.get(group) or {}
        if isinstance(sub, BaseModel):
            sub = sub.model_dump(exclude_unset=True)
        if not isinstance(sub, Mapping):
            raise ValueError(f"learner.{group} must be a mapping")
        if new in sub:
            raise ValueError(
                f"learner.{old} and learner.{group}.{new} both given; "
                f"keep only learner.{group}.{new} (learner.{old} is its old name)"
            )
        out[group] = {**sub, new: out.pop(old)}
        if old not in _warned:
            _warned.add(old)
            log.warning(
                "config: learner.%s is now learner.%s.%s (the old name still loads)",
                old,
                group,
                new,
            )
    return out


class LearnerConfig(StrictModel):
    """Defaults are the paper's (DAPO.md, Qwen2.5-32B); presets and files override them."""

    server: ServerConfig = Field(
        default_factory=lambda: ServerConfig(grpc_port=50053, http_port=8003)
    )
    model_path: str | None = Field(None, description="Local Hugging Face model directory.")
    engine: Literal["torch", "deepspeed"] = Field(
        "deepspeed", description="deepspeed (ZeRO, data parallel) or a plain torch loop."
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "bfloat16", description="Training dtype (DeepSpeed keeps fp32 master weights)."
    )
    device: str = Field(
        "auto",
        pattern=r"^(auto|cpu|cuda(:\d+)?)$",
        description="Where the policy and the reference model run: auto = this rank's GPU "
        "(cuda:LOCAL_RANK) when CUDA is present, else cpu; cpu, cuda (the rank's GPU) or "
        "cuda:N. DeepSpeed trains on its accelerator's device: cpu there, or cuda where it "
        "has none, is an error.",
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
    linger_s: float = Field(
        30.0, ge=0, description="After the last step, keep serving the final weights this long."
    )
    launch: LearnerLaunch = Field(default_factory=LearnerLaunch)
    objective: ObjectiveConfig = Field(default_factory=ObjectiveConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    batching: BatchingConfig = Field(default_factory=BatchingConfig)
    deepspeed: DeepSpeedConfig = Field(default_factory=DeepSpeedConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    publication: PublicationConfig = Field(default_factory=PublicationConfig)

    @model_validator(mode="before")
    @classmethod
    def _legacy_keys(cls, data: Any) -> Any:
        """Old files' flat keys (`learner.lr`) load into their sub-models, with a warning."""
        return move_legacy_keys(data) if isinstance(data, Mapping) else data

    @model_validator(mode="after")
    def _ranks_need_deepspeed(self) -> LearnerConfig:
        if self.launch.ranks > 1 and self.engine != "deepspeed":
            raise ValueError(
                f"learner.launch.ranks={self.launch.ranks} needs learner.engine=deepspeed "
                "(the torch engine trains in one process)"
            )
        return self


class LearnerSettings(RoleSettings):
    """The learner's process: shared, security and its own section."""

    learner: LearnerConfig = Field(default_factory=LearnerConfig)

    @classmethod
    def upgrade_layer(cls, data: Mapping[str, Any]) -> dict[str, Any]:
        """The learner section's old flat keys moved to their sub-models, layer by layer."""
        section = data.get("learner")
        if not isinstance(section, Mapping):
            return dict(data)
        return {**data, "learner": move_legacy_keys(section)}

    @model_validator(mode="after")
    def _resolve_correction(self) -> LearnerSettings:
        """None becomes token_tis when stale groups can be trained (hard bound > 0), else none."""
        objective = self.learner.objective
        if objective.correction is None:
            stale = self.shared.staleness_hard_bound > 0
            chosen = DEFAULT_CORRECTION if stale else NoCorrection()
            resolved = objective.model_copy(update={"correction": chosen})
            self.learner = self.learner.model_copy(update={"objective": resolved})
        return self

    @property
    def correction(self) -> Correction:
        """The correction in effect (`_resolve_correction` has replaced None)."""
        return self.learner.objective.correction or NoCorrection()

    @property
    def model_path(self) -> str | None:
        """The policy's starting point: the learner's model dir, else the shared one."""
        return self.learner.model_path or self.shared.model_path
