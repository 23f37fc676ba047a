"""Configuration of the controller: data, admission, routing (torch-free)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from services.common.server_config import ServerConfig, StrictModel
from services.common.settings import RoleSettings


class DatasetConfig(StrictModel):
    """Where prompts come from."""

    kind: Literal["parquet", "jsonl", "synthetic"] = "parquet"
    path: str | None = Field(None, description="Parquet or JSONL file (DAPO record format).")
    synthetic_task: Literal["max3", "copy2", "reverse2", "mixed", "runmax", "runsum"] = Field(
        "max3",
        description="A built-in task: max3/copy2/reverse2, `mixed` (max3 + copy2), or a "
        "reasoning task in the paper's Answer: format, runmax/runsum (docs/tasks.md).",
    )
    synthetic_size: int | None = Field(
        None, ge=1, description="Training prompts drawn from the synthetic task (None = all)."
    )
    shuffle: bool = True
    answer_balance: float = Field(
        0.0,
        ge=0,
        le=1,
        description="0: every prompt once per epoch (the paper's). Above 0, an epoch of as "
        "many prompts holds each the floor or ceiling of its expected count, proportional to "
        "count(its answer)^-a: answers' shares move from their frequency (0) to uniform (1); "
        "all-distinct answers keep the plain epoch. For tasks with few distinct answers whose "
        "rare ones are under-trained (the `tiny` demo: 0.5).",
    )


class EvalConfig(StrictModel):
    """Held-out evaluation: before and after training (`dapo up`), and every
    `every_steps` policy versions during it (the controller, on the run's rollout servers)."""

    enabled: bool = Field(
        True, description="Evaluate at all: the initial and the final policy, and the curve."
    )
    every_steps: int = Field(
        0,
        ge=0,
        description="During training, evaluate every N policy versions (= learner steps) on "
        "the run's rollout servers: the eval curve (report, progress bar, metrics); 0 = off.",
    )
    concurrency: int = Field(
        16, ge=1, description="GenerateGroups calls one in-run evaluation keeps in flight."
    )
    groups_per_call: int = Field(
        64,
        ge=1,
        description="Held-out prompts per GenerateGroups call (fewer, when an answer would "
        "not fit shared.rpc.max_message_bytes).",
    )
    data: str | None = Field(
        None,
        description="Parquet/JSONL file, or synthetic:TASK; None = the training "
        "task's held-out split when the dataset is synthetic (else no evaluation).",
    )
    n: int = Field(32, ge=1, description="Samples per prompt (avg@n; paper: 32).")
    limit: int | None = Field(None, ge=1, description="Evaluate only the first N prompts.")
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(0.7, gt=0, le=1, description="Paper's eval top-p.")
    hold_learner: bool = Field(
        False,
        description="The learner waits, after committing a version the curve evaluates, "
        "until that point is recorded: each point samples exactly its version and has the "
        "learner's cores; training pauses for every point (off: points run beside training).",
    )
    hold_max_s: float = Field(
        60.0, gt=0, description="Longest the learner waits for one point (hold_learner)."
    )
    engine: Literal["torch", "vllm"] = Field(
        "torch",
        description="Engine that samples the evaluation: torch, or vllm (with rollout.engine's "
        "settings when that is vLLM, else vLLM's defaults).",
    )


class ControllerConfig(StrictModel):
    """Feeding prompts to rollout servers and scored groups to the buffer."""

    server: ServerConfig = Field(default_factory=lambda: ServerConfig(http_port=8004))
    dataset: DatasetConfig = Field(default_factory=DatasetConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    apply_chat_template: bool = Field(True, description="Render prompts as a chat turn.")
    max_groups_in_flight: int = Field(64, ge=1, description="Groups generating at once.")
    max_train_backlog: int = Field(
        2048, ge=1, description="Pause admission while `train` holds this many groups."
    )
    rpc_timeout_s: float = Field(600.0, gt=0, description="Deadline of one GenerateGroup call.")
    groups_per_call: int = Field(
        1,
        ge=1,
        description="Groups admitted together and sent in one GenerateGroups call, scored in "
        "one Score call: fewer calls per group, for an engine that merges calls anyway (the "
        "torch engine). A call answers when its slowest group is done, so 1 (a call per "
        "group) with vLLM. Fewer when an answer would not fit shared.rpc.max_message_bytes.",
    )
    difficulty_window: int = Field(
        2,
        ge=0,
        description="Difficulty-aware admission: a prompt whose last N groups were all "
        "correct or all wrong sits out an epoch, doubling per further uniform group "
        "(services/controller/admission.py); 0 = off (the paper samples every prompt "
        "every epoch).",
    )
    max_rejected_in_a_row: int = Field(
        256,
        ge=0,
        description="Stop the run (non-zero exit, with the reasons) once this many groups in "
        "a row were rejected with none scored: nothing the data asks can succeed; 0 = never.",
    )
    difficulty_skip_epochs: int = Field(
        8, ge=1, description="The most consecutive epochs a prompt sits out before it is retried."
    )


class ControllerSettings(RoleSettings):
    """The controller's process: shared, security and its own section."""

    controller: ControllerConfig = Field(default_factory=ControllerConfig)
