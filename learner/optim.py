"""The optimiser both policy back ends use: AdamW with the paper's linear warm-up."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from learner.config import LearnerConfig


def warmup_factor(step: int, warmup_steps: int) -> float:
    """Linear warm-up from 1/warmup_steps to 1, then constant (the paper's schedule)."""
    if warmup_steps <= 0:
        return 1.0
    return min(1.0, (step + 1) / warmup_steps)


def adamw(params: Iterable[torch.nn.Parameter], cfg: LearnerConfig) -> torch.optim.AdamW:
    """torch AdamW as configured (DeepSpeed takes it as its client optimizer: no JIT ops)."""
    return torch.optim.AdamW(
        params,
        lr=cfg.optimizer.lr,
        betas=cfg.optimizer.betas,
        weight_decay=cfg.optimizer.weight_decay,
    )
