"""Every back end trains its module in train mode, so activation checkpointing acts.

transformers recomputes a decoder layer in backward only while `module.training` is true,
and `from_pretrained` returns a model in eval mode: a back end that never calls `train()`
silently stores every activation (DeepSpeed did, until the learner's 16k step ran out of
memory). These tests watch the forward of real training steps.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from learner_fixtures import make_groups

from learner.backends import build_policy
from learner.config import BatchingConfig, DeepSpeedConfig, LearnerConfig, OptimizerConfig
from learner.step import train_step

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def _cfg(engine: str, checkpointing: bool) -> LearnerConfig:
    return LearnerConfig(
        engine=engine,
        dtype="float32",
        deepspeed=DeepSpeedConfig(zero_stage=0),
        optimizer=OptimizerConfig(lr=1e-3, warmup_steps=0),
        batching=BatchingConfig(
            mini_batch_responses=64,
            micro_batch_tokens=4096,
            logprob_chunk_tokens=0,
            gradient_checkpointing=checkpointing,
        ),
    )


def _watched_step(model_dir: Path, engine: str, checkpointing: bool) -> tuple[list[bool], int]:
    """One training step: the `training` flag each decoder layer saw in its forward while
    gradients were on, and the bytes of the tensors autograd saved for backward."""
    cfg = _cfg(engine, checkpointing)
    policy = build_policy(str(model_dir), cfg)
    seen: list[bool] = []

    def watch(module: torch.nn.Module, args: object) -> None:
        if torch.is_grad_enabled():  # the training forward, not the log-prob recompute
            seen.append(module.training)

    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[0] += t.numel() * t.element_size()
        return t

    layers = policy.module.model.layers
    handles = [layer.register_forward_pre_hook(watch) for layer in layers]
    groups = make_groups(n_groups=4, group_size=8, seed=3)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            train_step(policy, groups, cfg, 0, 1.0, 16)
    finally:
        for h in handles:
            h.remove()
    return seen, saved[0]


@pytest.mark.parametrize("engine", ["torch", "deepspeed"])
def test_training_forward_runs_in_train_mode(tiny_model: Path, engine: str) -> None:
    seen, _ = _watched_step(tiny_model, engine, checkpointing=True)
    assert seen, "no training forward was observed"
    assert all(seen), f"{engine}: a training forward ran with module.training False"


def test_checkpointing_lowers_saved_activations_under_deepspeed(tiny_model: Path) -> None:
    """With checkpointing, the decoder layers' activations are recomputed, not saved."""
    _, with_ckpt = _watched_step(tiny_model, "deepspeed", checkpointing=True)
    _, without = _watched_step(tiny_model, "deepspeed", checkpointing=False)
    assert with_ckpt < 0.6 * without, (with_ckpt, without)
