"""The policy being trained, behind the narrow interface the DAPO step drives.

Two back ends implement `Policy`: `TorchPolicy` (one process, plain torch) and
`DeepSpeedPolicy` (ZeRO 0–3, data parallel). Neither returns logits: the step asks for
the final hidden states and applies the output head itself, chunk by chunk
(`learner/logprobs.py`), so full-vocabulary logits never exist for a whole sequence.
`backward` never rescales the loss (the DAPO loss is already divided by the global
token count of the mini-batch), so accumulation adds exact gradients.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from learner.async_checkpoint import PendingWrite


class CausalLM(Protocol):
    """A causal LM cut before its output head: what log-prob scoring needs."""

    def hidden_states(
        self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor | None = None
    ) -> Tensor:
        """The last layer's normed hidden states `[B, L, H]` (`position_ids`: packed rows)."""
        ...

    @property
    def lm_head(self) -> torch.nn.Module:
        """The output head, called as a module (ZeRO-3 gathers its weight in its hooks)."""
        ...


class Policy(CausalLM, Protocol):
    """What the DAPO step needs from a training engine."""

    # Whether `named_weights` may be read on another thread while the next step trains
    # (publishing copies a version in the background): not where gathering the weights
    # is a collective on the training thread (ZeRO-3).
    weight_copy_overlaps: bool

    @property
    def device(self) -> torch.device:
        """Where the trained weights live (`learner.device`, or DeepSpeed's accelerator)."""
        ...

    @property
    def module(self) -> PreTrainedModel:
        """The transformers model being trained, in train mode (checkpointing acts only
        while `training` is true)."""
        ...

    def backward(self, loss: Tensor, last: bool = True) -> None:
        """Accumulate gradients of `loss` (no scaling); `last`: the mini-batch's last one."""
        ...

    def step(self) -> float:
        """Clip, apply and zero the accumulated gradients; return the pre-clip grad norm."""
        ...

    def advance_schedule(self) -> None:
        """One rollout step done (the warm-up counts rollout steps)."""
        ...

    def lr(self) -> float: ...

    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """Full (gathered) weights for publishing to rollout servers, each tensor once (a
        tied weight under its first name: `model_io.unique_weights`)."""
        ...

    def weight_count(self) -> int:
        """How many tensors `named_weights` yields (known before gathering any)."""
        ...

    def save_checkpoint(self, directory: str | Path, tag: str, client_state: dict) -> None:
        """Everything needed to resume, plus `client_state`; `latest` is written last."""
        ...

    def checkpoint_snapshot(
        self, directory: str | Path, tag: str, client_state: dict
    ) -> list[PendingWrite]:
        """What `save_checkpoint` writes, copied to host memory for a background writer;
        neither written nor `latest` (learner/async_checkpoint.py)."""
        ...

    def load_checkpoint(self, directory: str | Path) -> dict | None:
        """Restore `latest`; its client state (None when there is no checkpoint)."""
        ...

    def save_pretrained(self, out_dir: str | Path, tokenizer_dir: str | Path | None) -> None:
        """Export the full model as a transformers directory."""
        ...
