"""The learner's batch: its records and how they become tensors.

`TrainSequence` is one response with its advantage and log-probs
(`sequences_from_groups` flattens scored groups into them); `LossInputs` is one
micro-batch as tensors, built by `collate` (padded rows) or `collate_packed` (whole
sequences end to end in one row). How a step's sequences are cut into mini- and
micro-batches is `learner.batch_plan`. The tensor layout and what may pack:
docs/architecture.md, "The batch's layout and packing".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from typing import Literal, NamedTuple

import numpy as np
import torch
from torch import Tensor

from learner.algorithm import group_advantages, overlong_filter_mask
from learner.config import LearnerConfig, MaskedIS, SequenceTIS
from services.common.types import (
    FloatArray,
    Group,
    IntArray,
    Sample,
    logprob_array,
    token_array,
    versions_per_token,
)


@dataclass
class TrainSequence:
    """One response ready for training: its tokens, advantage and log-probs.

    `old_logprobs` (π_old of each response token, `[len(response_ids)]`) is filled by
    the learner's recompute at the start of a step; until then the rollout engine's
    log-probs stand in for it.
    """

    prompt_ids: IntArray
    response_ids: IntArray
    rollout_logprobs: FloatArray | None
    advantage: float
    truncated: bool
    reward: float = 0.0
    policy_version: int = 0
    group_id: str = ""
    old_logprobs: Tensor | None = None
    ref_logprobs: Tensor | None = None  # π_ref per response token, set when a KL term is on
    token_versions: IntArray | None = None  # behaviour version per token; None: policy_version

    def __post_init__(self) -> None:  # arrays end to end; lists (tests) converted once
        self.prompt_ids = token_array(self.prompt_ids)
        self.response_ids = token_array(self.response_ids)
        if self.rollout_logprobs is not None:
            self.rollout_logprobs = logprob_array(self.rollout_logprobs)
        if self.token_versions is not None:
            self.token_versions = token_array(self.token_versions)

    def versions(self) -> IntArray:
        """The policy version of every response token (the behaviour policy of its log-prob)."""
        return versions_per_token(self.token_versions, len(self.response_ids), self.policy_version)

    @property
    def length(self) -> int:
        """Prompt plus response tokens: the row length before padding."""
        return len(self.prompt_ids) + len(self.response_ids)


def is_truncated(sample: Sample) -> bool:
    """A response that did not end on its own: cut at max length, or aborted."""
    return sample.truncated or sample.finish_reason != "stop"


def sequences_from_groups(
    groups: Sequence[Group], adv_epsilon: float = 1e-6, norm_adv_by_std: bool = True
) -> list[TrainSequence]:
    """Flatten groups into sequences, group by group, with group-relative advantages.

    The advantage uses `Sample.reward` (correctness plus any overlong penalty) of every
    sample in the group, truncated ones included: overlong filtering masks the loss, not
    the group statistics.
    """
    out: list[TrainSequence] = []
    for group in groups:
        rewards = torch.tensor([s.reward for s in group.samples], dtype=torch.float64)
        advantages = group_advantages(rewards, adv_epsilon, norm_adv_by_std).tolist()
        for sample, adv in zip(group.samples, advantages, strict=True):
            out.append(_sequence(group, sample, adv))
    return out


def _sequence(group: Group, sample: Sample, advantage: float) -> TrainSequence:
    if not group.prompt_token_ids:
        raise ValueError(f"group {group.group_id}: empty prompt (no logits for token 0)")
    logprobs = sample.logprobs if len(sample.logprobs) else None
    if logprobs is not None and len(logprobs) != len(sample.token_ids):
        raise ValueError(
            f"group {group.group_id}: {len(logprobs)} log-probs for "
            f"{len(sample.token_ids)} response tokens"
        )
    return TrainSequence(
        prompt_ids=token_array(group.prompt_token_ids),
        response_ids=sample.token_ids,
        rollout_logprobs=logprobs,
        advantage=float(advantage),
        truncated=is_truncated(sample),
        reward=sample.reward,
        policy_version=sample.policy_version,
        group_id=group.group_id,
        token_versions=sample.versions(),
    )


@dataclass
class LossInputs:
    """One micro-batch of B rows of length L holding S sequences; `check()` checks shapes."""

    input_ids: Tensor  # [B, L] int64: prompt + response, right-padded with pad_token_id
    attention_mask: Tensor  # [B, L] int64: 1 on real tokens (Hugging Face convention)
    response_mask: Tensor  # [B, L] bool: response tokens
    loss_mask: Tensor  # [B, L] bool: response tokens that count (overlong filtering applied)
    advantages: Tensor  # [B, L] float32: the row's advantage on response tokens, else 0
    old_logprobs: Tensor | None  # [B, L] float32: π_old of input_ids[b, t] on responses, else 0
    rollout_logprobs: Tensor | None  # [B, L] float32: the engine's log-probs, same layout
    ref_logprobs: Tensor | None  # [B, L] float32: the reference model's, same layout (KL only)
    truncated: Tensor  # [S] bool: response did not end on its own
    response_lengths: Tensor  # [S] int64
    index: Tensor  # [S] int64: position of each sequence in the list given to `collate`
    starts: Tensor  # [S] int64: flat index (row · L + column) of each sequence's first token
    position_ids: Tensor | None = None  # [B, L] int64: 0 at each packed sequence's start

    def check(self) -> None:
        """Raise ValueError unless every tensor has its declared shape and dtype."""
        b, length = self.input_ids.shape
        s = self.index.shape[0]
        expect = {
            "input_ids": ((b, length), torch.int64),
            "attention_mask": ((b, length), torch.int64),
            "response_mask": ((b, length), torch.bool),
            "loss_mask": ((b, length), torch.bool),
            "advantages": ((b, length), torch.float32),
            "old_logprobs": ((b, length), torch.float32),
            "rollout_logprobs": ((b, length), torch.float32),
            "ref_logprobs": ((b, length), torch.float32),
            "truncated": ((s,), torch.bool),
            "response_lengths": ((s,), torch.int64),
            "index": ((s,), torch.int64),
            "starts": ((s,), torch.int64),
            "position_ids": ((b, length), torch.int64),
        }
        for name, (shape, dtype) in expect.items():
            t = getattr(self, name)  # probe-ok: a LossInputs field, by its name
            if t is not None and (tuple(t.shape) != shape or t.dtype != dtype):
                raise ValueError(f"{name}: {tuple(t.shape)} {t.dtype}, expected {shape} {dtype}")

    @property
    def num_loss_tokens(self) -> int:
        """Tokens of this micro-batch that count in the loss."""
        return int(self.loss_mask.sum())

    def to(self, device: torch.device | str) -> LossInputs:
        """A copy with every tensor on `device`."""
        moved = {
            f.name: value.to(device)
            for f in fields(self)
            if (value := getattr(self, f.name)) is not None  # probe-ok: a dataclass field
        }
        return replace(self, **moved)


def collate(
    seqs: Sequence[TrainSequence], pad_token_id: int, overlong_filtering: bool = True
) -> LossInputs:
    """Pad `seqs` into one micro-batch (rows in the given order, L = longest row).

    `old_logprobs` is each row's learner recompute if set, else its rollout log-probs;
    it is None if some row has neither, as is `rollout_logprobs` if some row lacks them.
    """
    if not seqs:
        raise ValueError("collate needs at least one sequence")
    b, length = len(seqs), max(s.length for s in seqs)
    input_ids = torch.full((b, length), pad_token_id, dtype=torch.int64)
    attention = torch.zeros((b, length), dtype=torch.int64)
    response = torch.zeros((b, length), dtype=torch.bool)
    advantages = torch.zeros((b, length), dtype=torch.float32)
    for row, s in enumerate(seqs):
        p, n = len(s.prompt_ids), s.length
        input_ids[row, :n] = torch.from_numpy(np.concatenate([s.prompt_ids, s.response_ids]))
        attention[row, :n] = 1
        response[row, p:n] = True
        advantages[row, p:n] = s.advantage
    truncated = torch.tensor([s.truncated for s in seqs], dtype=torch.bool)
    loss_mask = (
        overlong_filter_mask(response, truncated) if overlong_filtering else response.clone()
    )
    return LossInputs(
        input_ids=input_ids,
        attention_mask=attention,
        response_mask=response,
        loss_mask=loss_mask,
        advantages=advantages,
        old_logprobs=_response_values(seqs, length, _old_or_rollout),
        rollout_logprobs=_response_values(seqs, length, lambda s: s.rollout_logprobs),
        ref_logprobs=_response_values(seqs, length, lambda s: s.ref_logprobs),
        truncated=truncated,
        response_lengths=torch.tensor([len(s.response_ids) for s in seqs], dtype=torch.int64),
        index=torch.arange(b, dtype=torch.int64),
        starts=torch.arange(b, dtype=torch.int64) * length,
    )


def _old_or_rollout(s: TrainSequence) -> Tensor | FloatArray | None:
    return s.old_logprobs if s.old_logprobs is not None else s.rollout_logprobs


def _response_values(
    seqs: Sequence[TrainSequence],
    length: int,
    get: Callable[[TrainSequence], Tensor | FloatArray | None],
) -> Tensor | None:
    """`[B, L]` float32 with each row's per-response-token values placed after its prompt."""
    out = torch.zeros((len(seqs), length), dtype=torch.float32)
    for row, s in enumerate(seqs):
        values = get(s)
        if values is None:
            return None
        p = len(s.prompt_ids)
        out[row, p : p + len(s.response_ids)] = torch.as_tensor(values, dtype=torch.float32)
    return out


def assign_old_logprobs(
    seqs: Sequence[TrainSequence],
    inputs: LossInputs,
    logprobs: Tensor,
    attr: Literal["old_logprobs", "ref_logprobs"] = "old_logprobs",
) -> None:
    """Store learner log-probs `[B, L]` (aligned with `input_ids`) on the sequences.

    `seqs` is the list that was given to `collate` (padded or packed) to build `inputs`;
    `attr` says whose log-probs they are: π_old (the default) or the KL reference's.
    """
    flat = logprobs.detach().float().cpu().flatten()
    for idx, start in zip(inputs.index.tolist(), inputs.starts.tolist(), strict=True):
        s = seqs[idx]
        begin = start + len(s.prompt_ids)
        setattr(s, attr, flat[begin : begin + len(s.response_ids)].clone())


class LossCounts(NamedTuple):
    """What a mini-batch's loss is divided by; all-reduce (sum) both across ranks."""

    tokens: int
    sequences: int


def loss_tokens(seqs: Sequence[TrainSequence], overlong_filtering: bool = True) -> list[int]:
    """Each response's tokens that count in the loss (0 where overlong filtering masks it)."""
    return [0 if overlong_filtering and s.truncated else len(s.response_ids) for s in seqs]


def loss_counts(seqs: Sequence[TrainSequence], overlong_filtering: bool = True) -> LossCounts:
    """Loss tokens and sequences with at least one loss token, known before any forward."""
    tokens = loss_tokens(seqs, overlong_filtering)
    return LossCounts(tokens=sum(tokens), sequences=sum(n > 0 for n in tokens))


def use_packing(cfg: LearnerConfig) -> bool:
    """Whether micro-batches may be packed: asked for (or `auto`), and nothing in the loss
    reduces per row. `learner.batch_plan.packs` decides `auto` per batch."""
    c = cfg.objective.correction
    per_row_weights = isinstance(c, SequenceTIS) or (
        isinstance(c, MaskedIS) and c.level == "sequence"
    )
    return (
        cfg.batching.packing is not False
        and cfg.objective.loss_agg_mode != "seq_mean_token_mean"
        and not per_row_weights
    )


def collate_packed(
    seqs: Sequence[TrainSequence], pad_token_id: int, overlong_filtering: bool = True
) -> LossInputs:
    """Pack `seqs` (in the given order) into one row `[1, Σ lengths]`.

    The same values in the same places as the padded collate of each sequence alone laid
    end to end, with `position_ids` restarting per sequence; built in one pass of numpy
    concatenations (a per-sequence collate was a quarter of a tiny step).
    """
    if not seqs:
        raise ValueError("collate needs at least one sequence")
    del pad_token_id  # a packed row has no padding
    n = len(seqs)
    prompt = np.fromiter((len(s.prompt_ids) for s in seqs), np.int64, n)
    response = np.fromiter((len(s.response_ids) for s in seqs), np.int64, n)
    lengths = prompt + response
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    total = int(lengths.sum())
    ids = np.concatenate([a for s in seqs for a in (s.prompt_ids, s.response_ids)])
    seq_of = np.repeat(np.arange(n), lengths)  # the sequence of every position
    position = np.arange(total) - np.repeat(starts, lengths)
    is_response = position >= prompt[seq_of]
    truncated = torch.tensor([s.truncated for s in seqs], dtype=torch.bool)
    response_mask = torch.from_numpy(is_response).unsqueeze(0)
    loss_mask = response_mask.clone()
    if overlong_filtering:
        loss_mask &= ~truncated[torch.from_numpy(seq_of)]
    per_seq = np.array([s.advantage for s in seqs], dtype=np.float32)
    advantages = np.where(is_response, per_seq[seq_of], np.float32(0.0))
    return LossInputs(
        input_ids=torch.from_numpy(ids.astype(np.int64, copy=False)).unsqueeze(0),
        attention_mask=torch.ones((1, total), dtype=torch.int64),
        response_mask=response_mask,
        loss_mask=loss_mask,
        advantages=torch.from_numpy(advantages.astype(np.float32, copy=False)).unsqueeze(0),
        old_logprobs=_packed_values(seqs, is_response, _old_or_rollout),
        rollout_logprobs=_packed_values(seqs, is_response, lambda s: s.rollout_logprobs),
        ref_logprobs=_packed_values(seqs, is_response, lambda s: s.ref_logprobs),
        truncated=truncated,
        response_lengths=torch.from_numpy(response),
        index=torch.arange(n, dtype=torch.int64),
        starts=torch.from_numpy(starts.astype(np.int64)),
        position_ids=torch.from_numpy(position).unsqueeze(0),
    )


def _packed_values(
    seqs: Sequence[TrainSequence],
    is_response: np.ndarray,
    get: Callable[[TrainSequence], Tensor | FloatArray | None],
) -> Tensor | None:
    """`[1, T]` float32 with each sequence's per-response-token values at its responses."""
    values = [get(s) for s in seqs]
    if any(v is None for v in values):
        return None
    out = np.zeros(is_response.shape[0], dtype=np.float32)
    if len(is_response) and is_response.any():
        out[is_response] = np.concatenate(
            [np.asarray(v, dtype=np.float32).reshape(-1) for v in values]
        )
    return torch.from_numpy(out).unsqueeze(0)
