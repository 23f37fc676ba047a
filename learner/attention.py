"""Attention that keeps packed sequences apart (`learner.batch` packs them end to end).

Registers `sdpa_varlen`: the packed row is cut at each restart of the position ids and
the sequences go to causal SDPA in length buckets, each bucket one call on its sequences
right-padded to the bucket's longest (causal attention never looks at a right pad, so
each real position sees exactly its own sequence). No `[T, T]` mask or scores exist; on
GPU `flash_attention_2`'s varlen path does the same in one call. Why, and what was
measured: docs/architecture.md, "The batch's layout and packing".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

VARLEN_SDPA = "sdpa_varlen"
# A sequence joins a bucket if it is at least this share of the bucket's longest: padded
# attention then costs at most 1 / BUCKET_RATIO² of the unpadded (causal: quadratic).
BUCKET_RATIO = 0.5


def segment_bounds(position_ids: Tensor) -> list[tuple[int, int]]:
    """`(start, end)` of each sequence in a packed row: a new one starts at each position 0."""
    starts = (position_ids == 0).nonzero().flatten().tolist()
    if not starts or starts[0] != 0:
        starts = [0, *starts]
    return list(zip(starts, [*starts[1:], int(position_ids.shape[-1])], strict=True))


def length_buckets(bounds: list[tuple[int, int]], ratio: float | None = None) -> list[list[int]]:
    """Indices into `bounds`, longest first, cut where a length falls below `ratio` (default
    `BUCKET_RATIO`) × the bucket's longest."""
    ratio = BUCKET_RATIO if ratio is None else ratio
    order = sorted(range(len(bounds)), key=lambda i: (bounds[i][0] - bounds[i][1], i))
    buckets: list[list[int]] = []
    for i in order:
        n = bounds[i][1] - bounds[i][0]
        if buckets and n >= ratio * (bounds[buckets[-1][0]][1] - bounds[buckets[-1][0]][0]):
            buckets[-1].append(i)
        else:
            buckets.append([i])
    return buckets


@dataclass(frozen=True)
class BucketPlan:
    """Gather and scatter indices of a packed row's length buckets (the same for every layer).

    `gathers[b]` is `[n_b, L_b]`: the packed positions of bucket b's sequences, right
    padded (a pad repeats the sequence's last position); `inverse` `[T]` is, for each
    packed position, its row in the concatenated `[n_b · L_b]` bucket outputs.
    """

    gathers: list[Tensor]
    inverse: Tensor


def bucket_plan(position_ids: Tensor) -> BucketPlan:
    """The buckets of one packed row `[T]` (on `position_ids`' device)."""
    bounds = segment_bounds(position_ids)
    gathers, rows = [], torch.empty(int(position_ids.shape[-1]), dtype=torch.long)
    offset = 0
    for bucket in length_buckets(bounds):
        longest = bounds[bucket[0]][1] - bounds[bucket[0]][0]
        idx = torch.empty((len(bucket), longest), dtype=torch.long)
        for r, i in enumerate(bucket):
            start, end = bounds[i]
            idx[r] = torch.arange(start, start + longest).clamp_(max=end - 1)
            rows[start:end] = offset + r * longest + torch.arange(end - start)
        gathers.append(idx.to(position_ids.device))
        offset += len(bucket) * longest
    return BucketPlan(gathers, rows.to(position_ids.device))


class _PlanCache:
    """The plan of the last packed row seen: every layer of a forward passes the same
    `position_ids` tensor, so the plan is built once per forward, not once per layer."""

    def __init__(self) -> None:
        self.key: tuple[Tensor, int] | None = None
        self.plan: BucketPlan | None = None

    def get(self, position_ids: Tensor) -> BucketPlan:
        key = self.key
        if key is None or key[0] is not position_ids or key[1] != position_ids._version:
            self.plan = bucket_plan(position_ids)
            self.key = (position_ids, position_ids._version)  # held: its id is not reused
        assert self.plan is not None
        return self.plan


_plans = _PlanCache()


def _gather(x: Tensor, idx: Tensor) -> Tensor:
    """`[1, H, T, D]` → `[n, H, L, D]` at the positions `idx` `[n, L]`."""
    heads, dim = x.shape[1], x.shape[3]
    picked = x[0].index_select(1, idx.flatten())  # [H, n·L, D]
    return picked.view(heads, idx.shape[0], idx.shape[1], dim).transpose(0, 1)


def varlen_sdpa_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """Causal SDPA per length bucket of packed sequences (`[1, H, T, D]` in, `[1, T, H, D]` out).

    Rows with a mask (padded micro-batches) or without position ids go to plain SDPA.
    """
    position_ids = kwargs.get("position_ids")
    if attention_mask is not None or position_ids is None or query.shape[0] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    plan = _plans.get(position_ids[0])
    outs = []
    for idx in plan.gathers:
        q, k, v = (_gather(t, idx) for t in (query, key, value))
        out, _ = sdpa_attention_forward(module, q, k, v, None, **kwargs)  # [n, L, H, D]
        outs.append(out.reshape(-1, out.shape[2], out.shape[3]))
    flat = outs[0] if len(outs) == 1 else torch.cat(outs)
    return flat.index_select(0, plan.inverse).unsqueeze(0), None


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
