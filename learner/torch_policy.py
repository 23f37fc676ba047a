"""`TorchPolicy`: the `Policy` protocol as a plain torch loop in one process.

AdamW with linear warm-up and gradient clipping, on CPU or one GPU. It has no
data parallelism: under a launcher with several ranks it refuses to start (DeepSpeed
covers that case, at any ZeRO stage).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor
from transformers import PreTrainedModel

from learner.async_checkpoint import PendingWrite, snapshot
from learner.attention import packed_attention
from learner.config import LearnerConfig
from learner.logprobs import LocalCausalLM
from learner.model_io import (
    enable_activation_checkpointing,
    load_state,
    save_hf,
    save_state,
    unique_weights,
)
from learner.optim import adamw, warmup_factor
from services.common.errors import DapoError


def launched_world_size() -> int:
    """Ranks launched: the larger of the launcher's WORLD_SIZE and torch.distributed's group."""
    dist = torch.distributed
    group = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return max(group, int(os.environ.get("WORLD_SIZE", "1")))


class TorchPolicy(LocalCausalLM):
    """Single-process torch training (CPU or one GPU)."""

    weight_copy_overlaps = True  # the weights are whole in this process: any thread reads

    def __init__(
        self, model: PreTrainedModel, cfg: LearnerConfig, device: torch.device | str = "cpu"
    ):
        if (world := launched_world_size()) > 1:
            raise DapoError(
                f"learner.engine=torch trains in one process, but {world} ranks were "
                "launched: use learner.engine=deepspeed for data parallelism (any "
                "deepspeed.zero_stage, 0 included), or launch one process"
            )
        if cfg.batching.gradient_checkpointing:
            enable_activation_checkpointing(model)
        self.device = torch.device(device)  # build_policy passes learner.device's
        torch.nn.Module.to(model, self.device)  # (transformers' typed `to` hides Module's)
        if cfg.batching.packing:
            packed_attention(model, self.device)
        self.model = model
        self.model.train()
        self.cfg = cfg
        self.optimizer = adamw(self.model.parameters(), cfg)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: warmup_factor(s, cfg.optimizer.warmup_steps)
        )

    @property
    def module(self) -> PreTrainedModel:
        return self.model

    def backward(self, loss: Tensor, last: bool = True) -> None:
        loss.backward()

    def step(self) -> float:
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optimizer.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def advance_schedule(self) -> None:
        """One rollout step done: warm-up counts rollout steps, not gradient updates."""
        self.scheduler.step()

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def weight_count(self) -> int:
        return len(unique_weights(self.model))

    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        for name, tensor in unique_weights(self.model):
            yield name, tensor.detach()

    def save_pretrained(self, out_dir: str | Path, tokenizer_dir: str | Path | None) -> None:
        save_hf(self.model, dict(self.model.state_dict()), out_dir, tokenizer_dir)

    def save_checkpoint(self, directory: str | Path, tag: str, client_state: dict) -> None:
        """Model, optimizer, schedule and `client_state` in one file; `latest` written last."""
        root = Path(directory)
        (root / tag).mkdir(parents=True, exist_ok=True)
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "client": client_state,
        }
        save_state(state, root / tag)
        tmp = root / "latest.tmp"
        tmp.write_text(tag)
        tmp.replace(root / "latest")

    def checkpoint_snapshot(
        self, directory: str | Path, tag: str, client_state: dict
    ) -> list[PendingWrite]:
        """What `save_checkpoint` writes, copied to host memory, not yet written."""
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "client": client_state,
        }
        return [PendingWrite(Path(directory) / tag, snapshot(state), save_state_dir)]

    def load_checkpoint(self, directory: str | Path) -> dict | None:
        """Restore the latest checkpoint; its client state, or None if there is none."""
        latest = Path(directory) / "latest"
        if not latest.is_file():
            return None
        state = load_state(Path(directory) / latest.read_text().strip())
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        return state["client"]


def save_state_dir(state: object, directory: Path) -> None:
    """`save_state` into `directory`, made first (a `PendingWrite`'s saver)."""
    assert isinstance(state, dict)
    directory.mkdir(parents=True, exist_ok=True)
    save_state(state, directory)
