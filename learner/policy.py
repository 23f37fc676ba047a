"""The policy being trained, behind a narrow interface the DAPO step drives.

`TorchPolicy` is a plain torch model + AdamW with linear warm-up and gradient clipping.
The step calls `forward` and `backward` once per micro-batch and `step` once per
mini-batch; `backward` never rescales the loss (the DAPO loss is already divided by the
global token count of the mini-batch), so accumulation adds exact gradients.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import torch
from torch import Tensor

from learner.config import LearnerConfig


class Policy(Protocol):
    """What the DAPO step needs from a training engine."""

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """Logits `[B, L, V]`."""
        ...

    def backward(self, loss: Tensor) -> None:
        """Accumulate gradients of `loss` (no scaling)."""
        ...

    def step(self) -> float:
        """Clip, apply and zero the accumulated gradients; return the pre-clip grad norm."""
        ...

    def lr(self) -> float: ...

    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """Full (gathered) weights for publishing to rollout servers."""
        ...


def warmup_factor(step: int, warmup_steps: int) -> float:
    """Linear warm-up from 1/warmup_steps to 1, then constant (the paper's schedule)."""
    if warmup_steps <= 0:
        return 1.0
    return min(1.0, (step + 1) / warmup_steps)


def load_model(model_path: str | Path, dtype: str = "float32") -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch_dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype)


class TorchPolicy:
    """Single-process torch training (CPU or one GPU)."""

    def __init__(self, model: torch.nn.Module, cfg: LearnerConfig, device: str = "cpu"):
        self.model = model.to(device)
        self.model.train()
        self.cfg = cfg
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: warmup_factor(s, cfg.warmup_steps)
        )

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        device = next(self.model.parameters()).device
        out = self.model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device))
        return out.logits

    def backward(self, loss: Tensor) -> None:
        loss.backward()

    def step(self) -> float:
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def advance_schedule(self) -> None:
        """One rollout step done: warm-up counts rollout steps, not gradient updates."""
        self.scheduler.step()

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        yield from self.model.state_dict().items()
