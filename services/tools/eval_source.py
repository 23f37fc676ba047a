"""Which model `dapo eval --run R` evaluates, named: the run's latest checkpoint by default
(its final export when the run finished there), or `--checkpoint final|base|stepN`.

A checkpoint is turned into a model directory once (`R/eval-models/stepN`, kept) from its
weights; only the run's own checkpoints are used (their directory carries its run id).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common.errors import DapoError
from services.tools.config import DapoConfig
from services.tools.run_dir import latest_checkpoint_step, read_record

EVAL_MODELS = "eval-models"


@dataclass(frozen=True)
class EvalSource:
    """A model directory and what it is: `step7`, `final` or `base`, its step and version."""

    model: str
    checkpoint: str
    step: int
    version: int

    def describe(self, run_dir: Path) -> str:
        return (
            f"evaluating {run_dir}'s {self.checkpoint} (step {self.step}, policy version "
            f"{self.version}): {self.model}"
        )


def resolve_source(run_dir: Path, config: DapoConfig, choice: str | None) -> EvalSource:
    """The model `--checkpoint choice` names in the run (None: latest)."""
    if choice == "base":
        if config.model_path is None:
            raise DapoError(f"{run_dir} names no model (shared.model_path)")
        return EvalSource(config.model_path, "base", 0, 0)
    directory = config.learner.checkpoint.dir
    if directory is None:
        raise DapoError(f"{run_dir} kept no checkpoints (learner.checkpoint.dir unset)")
    own_checkpoints(run_dir, Path(directory))
    latest = latest_checkpoint_step(config)
    final = final_source(run_dir, config)
    if choice in (None, "latest"):
        if final is not None and final.step == latest:
            return final
        if latest is None:
            raise DapoError(
                f"{run_dir} has no checkpoint of its own (it stopped before its first one): "
                "`--checkpoint base` evaluates its initial model"
            )
        return step_source(run_dir, config, latest)
    if choice == "final":
        if final is None:
            raise DapoError(
                f"{run_dir} has no final export (the run did not finish): `--checkpoint latest` "
                "evaluates its latest checkpoint"
            )
        return final
    step = choice.removeprefix("step")
    if not step.isdigit():
        raise DapoError(f"--checkpoint wants latest, final, base or stepN, got {choice!r}")
    return step_source(run_dir, config, int(step))


def own_checkpoints(run_dir: Path, directory: Path) -> None:
    """Refuse a checkpoint directory stamped with another run's id."""
    from learner.checkpoints import stamped_run

    record = read_record(run_dir)
    stamp = stamped_run(directory) if directory.is_dir() else None
    if record is not None and stamp is not None and stamp != record.run_id:
        raise DapoError(
            f"{directory} holds the checkpoints of run {stamp}, not of {run_dir}'s run "
            f"{record.run_id}: `--checkpoint base` or `--model DIR`"
        )


def final_source(run_dir: Path, config: DapoConfig) -> EvalSource | None:
    """The final export, when the run finished (its last segment exited 0 at that step)."""
    from learner.trainer import export_dir

    out = export_dir(config)
    record = read_record(run_dir)
    if out is None or not (out / "config.json").is_file():
        return None
    segments = record.segments if record is not None else []
    finished = [s for s in segments if s.get("exit_code") == 0]
    step = int(finished[-1].get("end_step", 0)) if finished else config.learner.total_steps
    return EvalSource(str(out), "final", step, done_version(run_dir, step))


def done_version(run_dir: Path, step: int) -> int:
    """The policy version of the step the run finished at: its checkpoint's, if kept."""
    from services.tools.run_dir import load_run

    config = load_run(run_dir)
    directory = config.learner.checkpoint.dir
    tag = Path(directory) / f"step{step}" if directory else None
    if tag is not None and tag.is_dir():
        return int(checkpoint_state(tag)[1].get("version", step))
    return step


def step_source(run_dir: Path, config: DapoConfig, step: int) -> EvalSource:
    """Checkpoint `stepN` as a model directory (written once under R/eval-models)."""
    assert config.learner.checkpoint.dir is not None
    tag = Path(config.learner.checkpoint.dir) / f"step{step}"
    if not tag.is_dir():
        raise DapoError(f"{run_dir} has no checkpoint step{step} (in {tag.parent})")
    out = run_dir / EVAL_MODELS / f"step{step}"
    weights, client = checkpoint_state(tag)
    if not (out / "config.json").is_file():
        if config.model_path is None:
            raise DapoError(f"{run_dir} names no model (shared.model_path)")
        write_model(weights, config.model_path, out)
    return EvalSource(str(out), f"step{step}", step, int(client.get("version", step)))


def checkpoint_state(tag: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """A checkpoint's model weights and its client state (step, version, run id), from a
    DeepSpeed (`mp_rank_00_model_states.pt`) or torch-engine (`state.json`) checkpoint."""
    import torch

    deepspeed = tag / "mp_rank_00_model_states.pt"
    if deepspeed.is_file():
        state = torch.load(deepspeed, map_location="cpu", weights_only=True)  # tensors, no code
        return dict(state["module"]), {k: state.get(k) for k in ("step", "version", "run_id")}
    if (tag / "state.json").is_file():
        from learner.model_io import load_state

        state = load_state(tag)
        return dict(state["model"]), dict(state["client"])
    raise DapoError(f"{tag} is not a checkpoint this dapo can read")


def write_model(weights: dict[str, Any], base: str, out: Path) -> None:
    """The base model with the checkpoint's weights, saved as a model directory."""
    from learner.model_io import load_model, save_hf

    model = load_model(base)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    if any(k in shapes and shapes[k] != v.shape for k, v in weights.items()):
        raise DapoError(
            "the checkpoint's weights are partitioned (ZeRO-3): convert it with DeepSpeed's "
            "zero_to_fp32.py and pass --model"
        )
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise DapoError(f"the checkpoint does not fit {base}: missing {missing[:3]}")
    save_hf(model, dict(model.state_dict()), out, base)
