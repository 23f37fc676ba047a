"""Attention that keeps packed sequences apart (`learner.batch` packs them end to end).

Registers `sdpa_varlen`: causal SDPA per packed sequence, cut at each restart of the
position ids, so no `[T, T]` mask or scores exist (on GPU, `flash_attention_2`'s varlen
path does the same). Why not transformers' `sdpa`, and what was measured:
docs/architecture.md, "The batch's layout and packing".
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

VARLEN_SDPA = "sdpa_varlen"


def segment_bounds(position_ids: Tensor) -> list[tuple[int, int]]:
    """`(start, end)` of each sequence in a packed row: a new one starts at each position 0."""
    starts = (position_ids == 0).nonzero().flatten().tolist()
    if not starts or starts[0] != 0:
        starts = [0, *starts]
    return list(zip(starts, [*starts[1:], int(position_ids.shape[-1])], strict=True))


def varlen_sdpa_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """Causal SDPA per packed sequence (`[1, H, T, D]` in, `[1, T, H, D]` out).

    Rows with a mask (padded micro-batches) or without position ids go to plain SDPA.
    """
    position_ids = kwargs.get("position_ids")
    if attention_mask is not None or position_ids is None or query.shape[0] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    outs = []
    for start, end in segment_bounds(position_ids[0]):
        out, _ = sdpa_attention_forward(
            module,
            query[:, :, start:end],
            key[:, :, start:end],
            value[:, :, start:end],
            None,
            **kwargs,
        )
        outs.append(out)
    return torch.cat(outs, dim=1), None


def _varlen_mask(*args: Any, **kwargs: Any) -> Tensor | None:
    """No mask for packed rows (the attention cuts them); SDPA's mask for padded ones."""
    if kwargs.get("attention_mask") is None:
        return None
    return sdpa_mask(*args, **kwargs)


AttentionInterface.register(VARLEN_SDPA, varlen_sdpa_forward)
AttentionMaskInterface.register(VARLEN_SDPA, _varlen_mask)


def packed_attention(model: PreTrainedModel, device: torch.device | str) -> str:
    """Switch `model` to an attention that keeps packed sequences apart; return its name."""
    from transformers.utils import is_flash_attn_2_available

    on_gpu = torch.device(device).type == "cuda"
    name = "flash_attention_2" if on_gpu and is_flash_attn_2_available() else VARLEN_SDPA
    model.set_attn_implementation(name)
    return name
