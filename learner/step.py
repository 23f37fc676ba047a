"""One DAPO training step over a batch of informative groups, on one rank or many.

π_old is recomputed on the learner at the start of the step; the responses are then
split into mini-batches (one optimizer update each, the same seeded split on every
rank), each mini-batch is dealt to the data-parallel ranks by token count, and each
rank's share is cut into micro-batches by token budget. Before the micro-batch loop the
mini-batch's loss token and sequence counts are all-reduced, and every micro-batch's
loss is divided by those global counts, so gradient accumulation and data parallelism
give exactly the full-batch gradient. Ranks run the same number of forwards (ZeRO-3
gathers parameters in each forward): a rank that has fewer micro-batches runs dummy
ones whose loss is multiplied by zero.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from learner.algorithm import agg_loss, kl_k3, masked_mean, per_token_loss, tis_weights
from learner.batching import (
    LossCounts,
    LossInputs,
    TrainSequence,
    assign_old_logprobs,
    balance_across_ranks,
    collate,
    logprobs_for_inputs,
    loss_counts,
    mini_batches,
    sequences_from_groups,
    token_budget_micro_batches,
)
from learner.config import LearnerConfig
from learner.dist import DataParallel, Single
from learner.policy import Policy
from learner.reference import Reference
from services.common.types import Group

MicroBatch = tuple[list[TrainSequence], bool]  # (rows, real); real=False: a dummy forward


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
    tokens_per_s: float = 0.0
    response_length: float = 0.0
    reward_mean: float = 0.0
    accuracy: float = 0.0
    logprob_gap: float = 0.0
    kl: float = 0.0
    updates: int = 0
    skipped_updates: int = 0  # mini-batches with no loss token left (all overlong-filtered)
    seconds: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def micro_batches(seqs: Sequence[TrainSequence], budget: int) -> list[list[TrainSequence]]:
    idx = token_budget_micro_batches([s.length for s in seqs], budget)
    return [[seqs[i] for i in batch] for batch in idx]


def plan_micro_batches(
    seqs: Sequence[TrainSequence], fallback: TrainSequence, budget: int, dp: DataParallel
) -> list[MicroBatch]:
    """This rank's micro-batches, padded with dummies to the largest count over ranks."""
    lengths = [s.length for s in seqs]
    idx = token_budget_micro_batches(lengths, budget) if seqs else []
    target = dp.all_reduce_max(len(idx))
    if seqs and len(idx) < target:
        idx = token_budget_micro_batches(lengths, budget, min_count=target)
    batches: list[MicroBatch] = [([seqs[i] for i in b], True) for b in idx]
    batches += [([fallback], False)] * (target - len(batches))
    return batches


def rank_share(seqs: Sequence[TrainSequence], mini: list[int], dp: DataParallel) -> list[int]:
    """The rows of mini-batch `mini` this rank trains (token totals balanced over ranks)."""
    if dp.world_size == 1:
        return list(mini)
    shares = balance_across_ranks([seqs[i].length for i in mini], dp.world_size)
    return [mini[j] for j in shares[dp.rank]]


def global_counts(seqs: Sequence[TrainSequence], overlong: bool, dp: DataParallel) -> LossCounts:
    """Loss tokens and sequences of the whole mini-batch, summed over ranks."""
    local = loss_counts(seqs, overlong)
    total = dp.all_reduce_sum(torch.tensor([local.tokens, local.sequences], dtype=torch.int64))
    return LossCounts(tokens=int(total[0]), sequences=int(total[1]))


@torch.no_grad()
def recompute_old_logprobs(
    policy: Policy,
    seqs: list[TrainSequence],
    cfg: LearnerConfig,
    pad_id: int,
    temperature: float,
    dp: DataParallel | None = None,
    fallback: TrainSequence | None = None,
    reference: Reference | None = None,
) -> float:
    """Fill each sequence's π_old (and π_ref when a reference is given).

    Returns the mean |learner − rollout| log-prob gap.
    """
    dp = dp or Single()
    sums = torch.zeros(2, dtype=torch.float64)  # |gap| sum, token count
    fallback = fallback or seqs[0]
    for batch, real in plan_micro_batches(seqs, fallback, cfg.micro_batch_tokens, dp):
        inputs = collate(batch, pad_id, cfg.overlong_filtering)
        logits = policy.forward(inputs.input_ids, inputs.attention_mask)
        if not real:
            continue
        logprobs, _ = logprobs_for_inputs(logits, inputs.input_ids.to(logits.device), temperature)
        assign_old_logprobs(batch, inputs, logprobs)
        if reference is not None:
            ref_logits = reference.forward(inputs.input_ids, inputs.attention_mask)
            ref, _ = logprobs_for_inputs(ref_logits, inputs.input_ids.to(ref_logits.device))
            assign_old_logprobs(batch, inputs, ref, attr="ref_logprobs")
        if inputs.rollout_logprobs is not None:
            mask = inputs.response_mask
            diff = (logprobs.float().cpu() - inputs.rollout_logprobs).abs()
            sums += torch.tensor([float(diff[mask].sum()), float(mask.sum())], dtype=torch.float64)
    sums = dp.all_reduce_sum(sums)
    return float(sums[0]) / max(float(sums[1]), 1.0)


def train_step(
    policy: Policy,
    groups: Sequence[Group],
    cfg: LearnerConfig,
    pad_id: int,
    temperature: float,
    max_response_length: int,
    seed: int = 0,
    dp: DataParallel | None = None,
    reference: Reference | None = None,
) -> StepMetrics:
    """Recompute π_old (and π_ref), then one optimizer update per mini-batch."""
    started = time.monotonic()
    dp = dp or Single()
    seqs = sequences_from_groups(groups, cfg.adv_epsilon, cfg.norm_adv_by_std)
    minis = mini_batches(len(seqs), cfg.mini_batch_responses, seed)
    shares = [rank_share(seqs, mb, dp) for mb in minis]
    own = [seqs[i] for share in shares for i in share]
    metrics = StepMetrics()
    metrics.logprob_gap = recompute_old_logprobs(
        policy, own, cfg, pad_id, temperature, dp, fallback=seqs[0], reference=reference
    )
    totals = torch.zeros(6, dtype=torch.float64)  # loss·tok, clip hi, clip lo, ent·tok, tok, kl·tok
    for mb, share in zip(minis, shares, strict=True):
        mine = [seqs[i] for i in share]
        counts = global_counts(mine, cfg.overlong_filtering, dp)
        if counts.tokens == 0:  # every response filtered: a step would only apply momentum
            metrics.skipped_updates += 1
            continue
        totals += accumulate(
            policy, mine, cfg, pad_id, temperature, max_response_length,
            dp, fallback=seqs[mb[0]], counts=counts,
        )  # fmt: skip
        metrics.grad_norm = policy.step()
        metrics.updates += 1
    _fill_metrics(metrics, dp.all_reduce_sum(totals), seqs, groups)
    metrics.lr = policy.lr()
    metrics.seconds = time.monotonic() - started
    metrics.tokens_per_s = sum(s.length for s in seqs) / max(metrics.seconds, 1e-9)
    return metrics


def _fill_metrics(
    metrics: StepMetrics, totals: torch.Tensor, seqs: list[TrainSequence], groups: Sequence[Group]
) -> None:
    tokens = max(float(totals[4]), 1.0)
    metrics.loss = float(totals[0]) / tokens
    metrics.clip_frac_high = float(totals[1]) / tokens
    metrics.clip_frac_low = float(totals[2]) / tokens
    metrics.entropy = float(totals[3]) / tokens
    metrics.kl = float(totals[5]) / tokens
    metrics.tokens = int(sum(len(s.response_ids) for s in seqs))
    metrics.response_length = metrics.tokens / max(len(seqs), 1)
    metrics.reward_mean = sum(s.reward for s in seqs) / max(len(seqs), 1)
    samples = [s for g in groups for s in g.samples]
    metrics.accuracy = sum(s.correct for s in samples) / max(len(samples), 1)


def accumulate(
    policy: Policy,
    seqs: list[TrainSequence],
    cfg: LearnerConfig,
    pad_id: int,
    temperature: float,
    max_response_length: int,
    dp: DataParallel | None = None,
    fallback: TrainSequence | None = None,
    counts: LossCounts | None = None,
) -> torch.Tensor:
    """Accumulate this rank's share of one mini-batch's gradient; return its metric sums.

    `seqs` is this rank's share; the counts (`global_counts`, unless given) are summed
    over ranks before any forward.
    """
    dp = dp or Single()
    counts = counts or global_counts(seqs, cfg.overlong_filtering, dp)
    plan = plan_micro_batches(seqs, fallback or seqs[0], cfg.micro_batch_tokens, dp)
    sums = torch.zeros(6, dtype=torch.float64)
    for k, (batch, real) in enumerate(plan):
        inputs = collate(batch, pad_id, cfg.overlong_filtering)
        logits = policy.forward(inputs.input_ids, inputs.attention_mask)
        inputs = inputs.to(logits.device)
        logprobs, entropy = logprobs_for_inputs(logits, inputs.input_ids, temperature)
        assert inputs.old_logprobs is not None
        kl = kl_term(logprobs, inputs, cfg)
        loss_mat, stats = per_token_loss(
            logprobs, inputs.old_logprobs, inputs.advantages, inputs.loss_mask,
            cfg.clip_ratio_low, cfg.clip_ratio_high, cfg.clip_ratio_c, cfg.logratio_clamp,
            is_weights=importance_weights(inputs, cfg), kl=kl, kl_coef=cfg.kl_coef,
        )  # fmt: skip
        loss = agg_loss(
            loss_mat, inputs.loss_mask, cfg.loss_agg_mode, counts.tokens, counts.sequences,
            max_response_length,
        )  # fmt: skip
        policy.backward(loss if real else loss * 0.0, last=k == len(plan) - 1)
        if real:
            sums += _micro_sums(float(loss.detach()), counts, stats, entropy, kl, inputs.loss_mask)
    return sums


def importance_weights(inputs: LossInputs, cfg: LearnerConfig) -> torch.Tensor | None:
    """Truncated IS weights π_old / π_rollout when `tis_cap` is set, else None."""
    if cfg.tis_cap is None:
        return None
    if inputs.rollout_logprobs is None or inputs.old_logprobs is None:
        raise ValueError("tis_cap is set but some responses came without rollout log-probs")
    return tis_weights(
        inputs.old_logprobs, inputs.rollout_logprobs, cfg.tis_cap, cfg.logratio_clamp
    )


def kl_term(logprobs: torch.Tensor, inputs: LossInputs, cfg: LearnerConfig) -> torch.Tensor | None:
    """Per-token k3 KL to the reference when `kl_coef` > 0, else None."""
    if cfg.kl_coef == 0.0:
        return None
    if inputs.ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs reference log-probs: pass a Reference to train_step")
    return kl_k3(logprobs, inputs.ref_logprobs.to(logprobs.device), cfg.logratio_clamp)


def _micro_sums(loss: float, counts: LossCounts, stats, entropy, kl, mask) -> torch.Tensor:
    n = float(stats.tokens)
    kl_mean = float(masked_mean(kl.detach(), mask)) if kl is not None else 0.0
    return torch.tensor(
        [loss * counts.tokens, float(stats.clipped_high), float(stats.clipped_low),
         float(masked_mean(entropy, mask)) * n, n, kl_mean * n],
        dtype=torch.float64,
    )  # fmt: skip
