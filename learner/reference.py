"""The frozen reference policy π_ref for the optional KL term (off in DAPO).

A plain torch copy of the initial model on every rank, in eval mode and without
gradients: it only ever runs forwards, so it needs neither an optimizer nor ZeRO
sharding. Under ZeRO-3 that costs one full copy of the weights per rank; DAPO leaves
the KL out (`kl_coef = 0`), and then no reference is built at all. It is scored like
the policy (`learner.logprobs.sequence_logprobs`): hidden states, then the head in chunks.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor
from transformers import PreTrainedModel

from learner.attention import packed_attention
from learner.logprobs import LocalCausalLM
from learner.model_io import load_model


class Reference(LocalCausalLM):
    """Forward-only hidden states and output head of the model the run started from."""

    def __init__(self, model: PreTrainedModel, device: torch.device | str = "cpu") -> None:
        torch.nn.Module.to(model, device)  # (transformers' typed `to` hides Module's)
        packed_attention(model, device)  # padded rows take plain SDPA through it too
        self.model = model.eval().requires_grad_(False)

    @classmethod
    def load(cls, model_path: str | Path, dtype: str, device: torch.device) -> Reference:
        """On `device`: the policy's (the Trainer passes it), so the KL term's log-probs
        meet the policy's on one device."""
        return cls(load_model(model_path, dtype), device)

    @torch.no_grad()
    def hidden_states(
        self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor | None = None
    ) -> Tensor:
        return super().hidden_states(input_ids, attention_mask, position_ids)
