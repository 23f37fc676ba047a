"""One DAPO training step over a batch of informative groups, on one rank or many.

Plan the mini- and micro-batches, recompute π_old (and π_ref), then per mini-batch
all-reduce the loss counts and run the micro-batches' losses divided by those global
counts, so gradient accumulation and data parallelism give exactly the full-batch
gradient. The pass step by step, and how ranks stay in lockstep: docs/architecture.md,
"One step".
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from learner.algorithm import (
    ClipStats,
    agg_loss,
    kl_k3,
    longest_loss_share,
    per_token_loss,
    policy_loss,
)
from learner.batch import (
    LossCounts,
    LossInputs,
    TrainSequence,
    assign_old_logprobs,
    collate,
    collate_packed,
    loss_tokens,
    sequences_from_groups,
)
from learner.batch_plan import MicroBatch, global_counts, packs, plan_micro_batches, plan_step
from learner.config import LearnerConfig, NoCorrection, ObjectiveConfig
from learner.correction import (
    OffPolicySums,
    correction_weights,
    mismatch_and_lag_sums,
    weight_sums,
)
from learner.dist import DataParallel, Single
from learner.logprobs import chunk_count, sequence_logprobs
from learner.old_logprobs import OldLogprobGate, gap_from_int, gap_to_int, same_version_gap
from learner.policy import CausalLM, Policy
from learner.step_metrics import StepMetrics, StepSums, report_batch, report_sums
from services.common.types import Group


def train_step(
    policy: Policy,
    groups: Sequence[Group],
    cfg: LearnerConfig,
    pad_id: int,
    temperature: float,
    max_response_length: int,
    seed: int = 0,
    dp: DataParallel | None = None,
    reference: CausalLM | None = None,
    version: int = 0,
    old_logprobs: OldLogprobGate | None = None,
) -> StepMetrics:
    """Recompute π_old (and π_ref), then one optimizer update per mini-batch.

    `version` is the policy version of the weights being trained (for the lag metrics);
    with `old_logprobs` (the trainer's gate) the recompute is skipped when it says so.
    """
    started = time.monotonic()
    dp = dp or Single()
    seqs = sequences_from_groups(groups, cfg.objective.adv_epsilon, cfg.objective.norm_adv_by_std)
    plan = plan_step(seqs, cfg.batching.mini_batch_responses, seed, dp)
    shares = [[seqs[i] for i in share] for share in plan]
    metrics = StepMetrics()
    rank_seqs = [s for share in shares for s in share]
    reuse = old_logprobs is not None and old_logprobs.reuse(seqs, version, reference is not None)
    if not reuse:
        recompute_old_logprobs(
            policy, rank_seqs, cfg, pad_id, temperature, dp, fallback=seqs[0], reference=reference
        )
    if old_logprobs is not None:
        measured = None if reuse else same_version_gap(rank_seqs, version)
        old_logprobs.record(
            None if reuse else gap_from_int(dp.all_reduce_max(gap_to_int(measured)))
        )
    metrics.old_logprobs_reused = int(reuse)
    off_policy, lag_max = off_policy_sums(rank_seqs, version)
    metrics.policy_lag_max = dp.all_reduce_max(lag_max)
    totals = StepSums(off_policy=off_policy)
    for mine in shares:
        counts = global_counts(mine, cfg.objective.overlong_filtering, dp)
        if counts.tokens == 0:  # every response filtered: a step would only apply momentum
            metrics.skipped_updates += 1
            continue
        totals += accumulate(
            policy,
            mine,
            cfg,
            pad_id,
            temperature,
            max_response_length,
            dp,
            fallback=seqs[0],
            counts=counts,
        )
        metrics.grad_norm = policy.step()
        metrics.updates += 1
    report_sums(metrics, reduce_sums(totals, dp))
    report_batch(metrics, seqs, groups)
    metrics.longest_loss_share = longest_loss_share(
        loss_tokens(seqs, cfg.objective.overlong_filtering), cfg.objective.loss_agg_mode
    )
    metrics.lr = policy.lr()
    metrics.seconds = time.monotonic() - started
    metrics.tokens_per_s = sum(s.length for s in seqs) / max(metrics.seconds, 1e-9)
    return metrics


def reduce_sums(sums: StepSums, dp: DataParallel) -> StepSums:
    """This rank's sums added over every rank: one all-reduce of one float64 vector."""
    return StepSums.from_tensor(dp.all_reduce_sum(sums.to_tensor()))


def micro_plan(
    seqs: list[TrainSequence], fallback: TrainSequence, cfg: LearnerConfig, dp: DataParallel
) -> tuple[list[MicroBatch], bool]:
    """This rank's micro-batches, cut for packing or for padding, and which of the two."""
    packed = packs(cfg, [s.length for s in seqs])
    return plan_micro_batches(seqs, fallback, cfg.batching.micro_batch_tokens, dp, packed), packed


def collate_micro(
    batch: list[TrainSequence], pad_id: int, cfg: LearnerConfig, packed: bool
) -> LossInputs:
    """One micro-batch's tensors: one packed row, or rows padded to the longest."""
    if packed:
        return collate_packed(batch, pad_id, cfg.objective.overlong_filtering)
    return collate(batch, pad_id, cfg.objective.overlong_filtering)


def score(
    model: CausalLM, inputs: LossInputs, cfg: LearnerConfig, temperature: float, dp: DataParallel
) -> tuple[Tensor, Tensor]:
    """Log-probs and entropy `[B, L]` of `inputs`; the head runs as many chunks on every rank."""
    chunks = dp.all_reduce_max(chunk_count(inputs, cfg.batching.logprob_chunk_tokens))
    return sequence_logprobs(model, inputs, temperature, cfg.batching.logprob_chunk_tokens, chunks)


@torch.no_grad()
def recompute_old_logprobs(
    policy: Policy,
    seqs: list[TrainSequence],
    cfg: LearnerConfig,
    pad_id: int,
    temperature: float,
    dp: DataParallel | None = None,
    fallback: TrainSequence | None = None,
    reference: CausalLM | None = None,
) -> None:
    """Fill each sequence's π_old (and π_ref when a reference is given)."""
    dp = dp or Single()
    plan, packed = micro_plan(seqs, fallback or seqs[0], cfg, dp)
    for batch, real in plan:
        inputs = collate_micro(batch, pad_id, cfg, packed)
        logprobs, _ = score(policy, inputs, cfg, temperature, dp)
        if not real:
            continue
        assign_old_logprobs(batch, inputs, logprobs)
        if reference is not None:
            ref, _ = score(reference, inputs, cfg, 1.0, Single())
            assign_old_logprobs(batch, inputs, ref, attr="ref_logprobs")


def off_policy_sums(seqs: list[TrainSequence], version: int) -> tuple[OffPolicySums, int]:
    """Engine-mismatch and policy-lag sums over this rank's sequences, and the largest lag.

    Only responses with engine log-probs count; run after `recompute_old_logprobs`.
    """
    known = [s for s in seqs if s.rollout_logprobs is not None and s.old_logprobs is not None]
    if not known:
        return OffPolicySums(), 0
    versions = torch.from_numpy(np.concatenate([s.versions() for s in known]))
    prox = torch.cat([s.old_logprobs for s in known if s.old_logprobs is not None])
    engine = [s.rollout_logprobs for s in known if s.rollout_logprobs is not None]
    behav = torch.from_numpy(np.concatenate(engine))
    lag_max = int((version - versions).max())
    return mismatch_and_lag_sums(prox, behav, versions, version), lag_max


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
) -> StepSums:
    """Accumulate this rank's share of one mini-batch's gradient; return its metric sums.

    `seqs` is this rank's share; the counts (`global_counts`, unless given) are summed
    over ranks before any forward.
    """
    dp = dp or Single()
    counts = counts or global_counts(seqs, cfg.objective.overlong_filtering, dp)
    plan, packed = micro_plan(seqs, fallback or seqs[0], cfg, dp)
    sums = StepSums()
    for k, (batch, real) in enumerate(plan):
        inputs = collate_micro(batch, pad_id, cfg, packed)
        logprobs, entropy = score(policy, inputs, cfg, temperature, dp)
        inputs = inputs.to(logprobs.device)
        loss, stats, kl, w = micro_batch_loss(logprobs, inputs, cfg, counts, max_response_length)
        policy.backward(loss if real else loss * 0.0, last=k == len(plan) - 1)
        if real:
            sums += _micro_sums(
                float(loss.detach()), counts, stats, entropy, kl, w, inputs.loss_mask
            )
    return sums


def micro_batch_loss(
    logprobs: Tensor,
    inputs: LossInputs,
    cfg: LearnerConfig,
    counts: LossCounts,
    max_response_length: int,
) -> tuple[Tensor, ClipStats, Tensor | None, Tensor | None]:
    """The micro-batch's share of the mini-batch loss (divided by the global `counts`),
    its clip statistics, the KL term and the off-policy weights (None when off)."""
    if inputs.old_logprobs is None:
        raise ValueError("no π_old: run recompute_old_logprobs first")
    objective = cfg.objective
    kl = kl_term(logprobs, inputs, objective)
    weights = importance_weights(inputs, objective)
    policy, stats = policy_loss(
        logprobs,
        inputs.old_logprobs,
        inputs.advantages,
        inputs.loss_mask,
        objective.clip_ratio_low,
        objective.clip_ratio_high,
        objective.clip_ratio_c,
        objective.logratio_clamp,
    )
    loss_mat = per_token_loss(policy, weights, kl, objective.kl_coef)
    loss = agg_loss(
        loss_mat,
        inputs.loss_mask,
        objective.loss_agg_mode,
        counts.tokens,
        counts.sequences,
        max_response_length,
    )
    return loss, stats, kl, weights


def importance_weights(inputs: LossInputs, objective: ObjectiveConfig) -> Tensor | None:
    """The off-policy weights π_old / π_behav of `objective.correction` (None when off)."""
    correction = objective.correction
    if correction is None or isinstance(correction, NoCorrection):
        return None
    if inputs.rollout_logprobs is None or inputs.old_logprobs is None:
        raise ValueError(
            f"correction {correction.kind!r} needs the engine's log-probs of every response"
        )
    return correction_weights(
        correction,
        inputs.old_logprobs,
        inputs.rollout_logprobs,
        inputs.response_mask,
        objective.logratio_clamp,
    )


def kl_term(logprobs: Tensor, inputs: LossInputs, objective: ObjectiveConfig) -> Tensor | None:
    """Per-token k3 KL to the reference when `kl_coef` > 0, else None."""
    if objective.kl_coef == 0.0:
        return None
    if inputs.ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs reference log-probs: pass a Reference to train_step")
    return kl_k3(logprobs, inputs.ref_logprobs.to(logprobs.device), objective.logratio_clamp)


def _micro_sums(
    loss: float,
    counts: LossCounts,
    stats: ClipStats,
    entropy: Tensor,
    kl: Tensor | None,
    weights: Tensor | None,
    mask: Tensor,
) -> StepSums:
    """One micro-batch's sums over its loss tokens (`mask`), on the CPU in float64."""
    is_weight, is_masked = weight_sums(weights, mask)
    return StepSums(
        clip=ClipStats(
            clipped_high=_cpu(stats.clipped_high),
            clipped_low=_cpu(stats.clipped_low),
            dual_clipped=_cpu(stats.dual_clipped),
            tokens=_cpu(stats.tokens),
        ),
        loss=loss * counts.tokens,
        entropy=_masked_sum(entropy, mask),
        kl=_masked_sum(kl.detach(), mask) if kl is not None else 0.0,
        is_weight=is_weight,
        is_masked=is_masked,
    )


def _cpu(count: Tensor) -> Tensor:
    return count.detach().to("cpu", torch.float64)


def _masked_sum(values: Tensor, mask: Tensor) -> float:
    return float(torch.where(mask.bool(), values, torch.zeros_like(values)).sum())
