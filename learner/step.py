"""One DAPO training step over a batch of informative groups.

π_old is recomputed on the learner at the start of the step; the responses are then
split into mini-batches (one optimizer update each) and each mini-batch into micro-batches
by token budget. The token-level loss of every micro-batch is divided by the token count
of its whole mini-batch, known before the micro-batch loop, so gradient accumulation
gives exactly the full-batch gradient.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from learner.algorithm import agg_loss, masked_mean, per_token_loss
from learner.batching import (
    TrainSequence,
    assign_old_logprobs,
    collate,
    logprobs_for_inputs,
    loss_counts,
    mini_batches,
    sequences_from_groups,
    token_budget_micro_batches,
)
from learner.config import LearnerConfig
from learner.policy import Policy
from services.common.types import Group


@dataclass
class StepMetrics:
    """What one step reports (metrics, the progress bar, report.json)."""

    loss: float = 0.0
    clip_frac_high: float = 0.0
    clip_frac_low: float = 0.0
    entropy: float = 0.0
    grad_norm: float = 0.0
    lr: float = 0.0
    tokens: int = 0
    response_length: float = 0.0
    reward_mean: float = 0.0
    accuracy: float = 0.0
    logprob_gap: float = 0.0
    updates: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def micro_batches(seqs: Sequence[TrainSequence], budget: int) -> list[list[TrainSequence]]:
    idx = token_budget_micro_batches([s.length for s in seqs], budget)
    return [[seqs[i] for i in batch] for batch in idx]


@torch.no_grad()
def recompute_old_logprobs(
    policy: Policy, seqs: list[TrainSequence], cfg: LearnerConfig, pad_id: int, temperature: float
) -> float:
    """Fill each sequence's π_old; return the mean |learner − rollout| log-prob gap."""
    gaps, count = 0.0, 0
    for batch in micro_batches(seqs, cfg.micro_batch_tokens):
        inputs = collate(batch, pad_id, cfg.overlong_filtering)
        logits = policy.forward(inputs.input_ids, inputs.attention_mask)
        logprobs, _ = logprobs_for_inputs(logits, inputs.input_ids.to(logits.device), temperature)
        assign_old_logprobs(batch, inputs, logprobs)
        if inputs.rollout_logprobs is not None:
            mask = inputs.response_mask
            diff = (logprobs.float().cpu() - inputs.rollout_logprobs).abs()
            gaps += float(diff[mask].sum())
            count += int(mask.sum())
    return gaps / max(count, 1)


def train_step(
    policy: Policy,
    groups: Sequence[Group],
    cfg: LearnerConfig,
    pad_id: int,
    temperature: float,
    max_response_length: int,
    seed: int = 0,
) -> StepMetrics:
    """Recompute π_old, then one optimizer update per mini-batch."""
    started = time.monotonic()
    seqs = sequences_from_groups(groups, cfg.adv_epsilon, cfg.norm_adv_by_std)
    metrics = StepMetrics()
    metrics.logprob_gap = recompute_old_logprobs(policy, seqs, cfg, pad_id, temperature)
    totals = torch.zeros(5, dtype=torch.float64)  # loss·tok, clip high, clip low, ent·tok, tok
    for mb in mini_batches(len(seqs), cfg.mini_batch_responses, seed):
        totals += _update(policy, [seqs[i] for i in mb], cfg, pad_id, temperature,
                          max_response_length)  # fmt: skip
        metrics.grad_norm = policy.step()
        metrics.updates += 1
    tokens = max(float(totals[4]), 1.0)
    metrics.loss = float(totals[0]) / tokens
    metrics.clip_frac_high = float(totals[1]) / tokens
    metrics.clip_frac_low = float(totals[2]) / tokens
    metrics.entropy = float(totals[3]) / tokens
    metrics.tokens = int(sum(len(s.response_ids) for s in seqs))
    metrics.response_length = metrics.tokens / max(len(seqs), 1)
    metrics.reward_mean = sum(s.reward for s in seqs) / max(len(seqs), 1)
    samples = [s for g in groups for s in g.samples]
    metrics.accuracy = sum(s.correct for s in samples) / max(len(samples), 1)
    metrics.lr = policy.lr()
    metrics.seconds = time.monotonic() - started
    return metrics


def _update(
    policy: Policy,
    seqs: list[TrainSequence],
    cfg: LearnerConfig,
    pad_id: int,
    temperature: float,
    max_response_length: int,
) -> torch.Tensor:
    """Accumulate the gradient of one mini-batch; return its metric sums."""
    counts = loss_counts(seqs, cfg.overlong_filtering)
    sums = torch.zeros(5, dtype=torch.float64)
    for batch in micro_batches(seqs, cfg.micro_batch_tokens):
        inputs = collate(batch, pad_id, cfg.overlong_filtering)
        logits = policy.forward(inputs.input_ids, inputs.attention_mask)
        inputs = inputs.to(logits.device)
        logprobs, entropy = logprobs_for_inputs(logits, inputs.input_ids, temperature)
        assert inputs.old_logprobs is not None
        loss_mat, stats = per_token_loss(
            logprobs, inputs.old_logprobs, inputs.advantages, inputs.loss_mask,
            cfg.clip_ratio_low, cfg.clip_ratio_high, cfg.clip_ratio_c, cfg.logratio_clamp,
        )  # fmt: skip
        loss = agg_loss(
            loss_mat, inputs.loss_mask, cfg.loss_agg_mode, counts.tokens, counts.sequences,
            max_response_length,
        )  # fmt: skip
        policy.backward(loss)
        n = float(stats.tokens)
        sums += torch.tensor(
            [float(loss.detach()) * counts.tokens, float(stats.clipped_high),
             float(stats.clipped_low), float(masked_mean(entropy, inputs.loss_mask)) * n, n],
            dtype=torch.float64,
        )  # fmt: skip
    return sums
