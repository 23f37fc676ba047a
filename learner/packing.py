"""Packed micro-batches: whole sequences laid end to end in one row, no padding.

A packed micro-batch is one row `[1, T]` of sequences (prompt + response each), chosen
by `micro_batches.packed_micro_batches` so that `T` ≤ the token budget (a longer sequence
gets a row of its own). `position_ids` restart at 0 for each sequence; the model's
attention (`learner.attention`) keeps the sequences apart, so every sequence is scored
as if it were alone in its row.

Every per-token tensor keeps `learner.batching`'s layout: token t of the row is scored
by the hidden state at t − 1. A sequence's first token is a prompt token (prompts are
never empty), so no scored token looks across a sequence boundary.

What reduces per row needs one sequence per row, so it keeps padded rows (`use_packing`):
`seq_mean_token_mean` (GRPO's per-sequence mean) and the sequence-level off-policy
corrections (`seq_tis`, `mis` at sequence level). DAPO's token mean, Dr.GRPO's constant
norm and the token-level corrections are sums over tokens and pack.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

import torch

from learner.batching import LossInputs, TrainSequence, collate
from learner.config import LearnerConfig, MaskedIS, SequenceTIS


def use_packing(cfg: LearnerConfig) -> bool:
    """Whether micro-batches are packed: asked for, and nothing in the loss reduces per row."""
    c = cfg.correction
    per_row_weights = isinstance(c, SequenceTIS) or (
        isinstance(c, MaskedIS) and c.level == "sequence"
    )
    return cfg.packing and cfg.loss_agg_mode != "seq_mean_token_mean" and not per_row_weights


def collate_packed(
    seqs: Sequence[TrainSequence], pad_token_id: int, overlong_filtering: bool = True
) -> LossInputs:
    """Pack `seqs` (in the given order) into one row `[1, Σ lengths]`.

    Built as the padded collate of each sequence alone, laid end to end: the same values
    in the same places, with `position_ids` restarting per sequence.
    """
    if not seqs:
        raise ValueError("collate needs at least one sequence")
    parts = [collate([s], pad_token_id, overlong_filtering) for s in seqs]
    starts = [0, *accumulate(s.length for s in seqs)][:-1]

    def row(name: str) -> torch.Tensor | None:
        values = [getattr(p, name) for p in parts]  # probe-ok: a LossInputs field by name
        return None if any(v is None for v in values) else torch.cat(values, dim=1)

    def joined(name: str) -> torch.Tensor:
        return torch.cat([getattr(p, name) for p in parts])  # probe-ok: a field by name

    return LossInputs(
        input_ids=torch.cat([p.input_ids for p in parts], dim=1),
        attention_mask=torch.cat([p.attention_mask for p in parts], dim=1),
        response_mask=torch.cat([p.response_mask for p in parts], dim=1),
        loss_mask=torch.cat([p.loss_mask for p in parts], dim=1),
        advantages=torch.cat([p.advantages for p in parts], dim=1),
        old_logprobs=row("old_logprobs"),
        rollout_logprobs=row("rollout_logprobs"),
        ref_logprobs=row("ref_logprobs"),
        truncated=joined("truncated"),
        response_lengths=joined("response_lengths"),
        index=torch.arange(len(seqs), dtype=torch.int64),
        starts=torch.tensor(starts, dtype=torch.int64),
        position_ids=torch.cat([torch.arange(s.length) for s in seqs]).unsqueeze(0),
    )
