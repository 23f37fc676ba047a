"""Per-token log-probs and entropy of a causal LM without `[L, V]` logits at once.

The output head runs over at most `chunk` response positions at a time, each chunk
checkpointed, so at most one chunk's `[chunk, V]` tensors exist in forward and backward
(`chunk = 0` is the full-logits baseline). Why and how: docs/architecture.md, "Log-probs
without `[L, V]` logits".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from learner.algorithm import token_logprobs

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from learner.batch import LossInputs
    from learner.policy import CausalLM


def final_hidden_states(
    model: Callable[..., Any],
    input_ids: Tensor,
    attention_mask: Tensor,
    position_ids: Tensor | None = None,
) -> Tensor:
    """The last layer's normed hidden states `[B, L, H]` of a transformers causal LM.

    The model is called whole (a DeepSpeed engine keeps its forward hooks), keeping the
    logits of no position (an empty index): its head still runs, on zero rows. With
    `position_ids` (packed rows) no mask is passed: transformers then reads the sequence
    boundaries from the positions (`learner.attention`).
    """
    if position_ids is not None:
        position_ids = position_ids.to(input_ids.device)
    out = model(
        input_ids=input_ids,
        attention_mask=None if position_ids is not None else attention_mask,
        position_ids=position_ids,
        output_hidden_states=True,
        logits_to_keep=torch.zeros(0, dtype=torch.long, device=input_ids.device),
        use_cache=False,
    )
    return out.hidden_states[-1]


def output_head(model: PreTrainedModel) -> torch.nn.Module:
    """The output head, called as a module (ZeRO-3 gathers its weight in its hooks)."""
    head = model.get_output_embeddings()
    assert isinstance(head, torch.nn.Module)
    return head


class LocalCausalLM:
    """The `CausalLM` side of a transformers model held in `self.model` in this process
    (the plain-torch policy and the frozen reference)."""

    model: PreTrainedModel

    def hidden_states(
        self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor | None = None
    ) -> Tensor:
        device = next(self.model.parameters()).device
        ids, mask = input_ids.to(device), attention_mask.to(device)
        return final_hidden_states(self.model, ids, mask, position_ids)

    @property
    def lm_head(self) -> torch.nn.Module:
        return output_head(self.model)


def _head_chunk(
    head: torch.nn.Module, hidden: Tensor, targets: Tensor, temperature: float
) -> tuple[Tensor, Tensor]:
    return token_logprobs(head(hidden), targets, temperature)


def head_logprobs(
    hidden: Tensor,
    head: torch.nn.Module,
    targets: Tensor,
    temperature: float,
    chunk: int,
    min_chunks: int = 1,
) -> tuple[Tensor, Tensor]:
    """Log-probs and entropy `[N]` of `targets` given `hidden` `[N, H]`, `chunk` rows at a time.

    `min_chunks` splits the rows into at least that many (possibly empty) chunks: data
    parallel ranks under ZeRO-3 must call the head the same number of times.
    """
    if chunk < 1:
        raise ValueError("chunk must be >= 1")
    count = max(-(-hidden.shape[0] // chunk), min_chunks, 1)
    logprobs, entropies = [], []
    # One split (its backward concatenates the chunks' gradients once), not per-chunk
    # indexing (whose backward would scatter into a zero `[N, H]` per chunk).
    for h, t in zip(hidden.tensor_split(count), targets.tensor_split(count), strict=True):
        if torch.is_grad_enabled():
            lp, ent = checkpoint(_head_chunk, head, h, t, temperature, use_reentrant=False)
        else:
            lp, ent = _head_chunk(head, h, t, temperature)
        logprobs.append(lp)
        entropies.append(ent)
    return torch.cat(logprobs), torch.cat(entropies)


def chunk_count(inputs: LossInputs, chunk: int) -> int:
    """Head calls `sequence_logprobs` makes for `inputs` (1 on the full path)."""
    if chunk == 0:
        return 1
    return max(-(-int(inputs.response_mask[:, 1:].sum()) // chunk), 1)


def logprobs_for_inputs(
    logits: Tensor, input_ids: Tensor, temperature: float = 1.0
) -> tuple[Tensor, Tensor]:
    """Log-probs and entropy `[B, L]` aligned with `input_ids`, from causal-LM logits `[B, L, V]`.

    Token t is scored by the logits at t − 1; column 0 (never a response token) is 0.
    """
    logprobs, entropy = token_logprobs(logits[:, :-1], input_ids[:, 1:], temperature)
    pad = logprobs.new_zeros((logprobs.shape[0], 1))
    return torch.cat([pad, logprobs], dim=1), torch.cat([pad, entropy], dim=1)


def _place(values: Tensor, scored: Tensor) -> Tensor:
    """`[B, L]` with `values` at the response positions `scored` (`[B, L − 1]`) after column 0."""
    body = values.new_zeros(scored.shape).masked_scatter(scored, values)
    return torch.cat([values.new_zeros((scored.shape[0], 1)), body], dim=1)


def sequence_logprobs(
    model: CausalLM,
    inputs: LossInputs,
    temperature: float,
    chunk: int,
    min_chunks: int = 1,
) -> tuple[Tensor, Tensor]:
    """Log-probs and entropy `[B, L]` aligned with `inputs.input_ids`.

    With `chunk` > 0 only response tokens are scored (0 elsewhere); `chunk = 0` scores
    every position from full `[B, L, V]` logits (the baseline).
    """
    hidden = model.hidden_states(inputs.input_ids, inputs.attention_mask, inputs.position_ids)
    ids = inputs.input_ids.to(hidden.device)
    if chunk == 0:
        return logprobs_for_inputs(model.lm_head(hidden), ids, temperature)
    scored = inputs.response_mask[:, 1:].to(hidden.device)  # t − 1 predicts token t
    lp, ent = head_logprobs(
        hidden[:, :-1][scored], model.lm_head, ids[:, 1:][scored], temperature, chunk, min_chunks
    )
    return _place(lp, scored), _place(ent, scored)
