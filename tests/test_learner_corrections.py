"""The learner's optional corrections, wired into the step: the off-policy correction
against the rollout engine's log-probs (`correction`) and a KL term to a frozen reference
(`kl_coef`). Both are off in DAPO; when on, they must change the gradient exactly as
the algorithm and correction modules say.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from learner_fixtures import hand_logprobs, make_groups

from learner.algorithm import agg_loss, kl_k3
from learner.batch import collate, loss_counts, sequences_from_groups, use_packing
from learner.config import (
    BatchingConfig,
    LearnerConfig,
    MaskedIS,
    ObjectiveConfig,
    OptimizerConfig,
    SequenceTIS,
    TokenTIS,
    TwoSidedMask,
)
from learner.logprobs import sequence_logprobs
from learner.model_io import load_model
from learner.reference import Reference
from learner.step import accumulate, recompute_old_logprobs, train_step
from learner.torch_policy import TorchPolicy

MAX_LEN = 16


def _cfg(packing: bool = True, **objective) -> LearnerConfig:
    return LearnerConfig(
        optimizer=OptimizerConfig(lr=1e-3),
        batching=BatchingConfig(micro_batch_tokens=64, packing=packing),
        objective=ObjectiveConfig(**objective),
    )


def _prepared(model: Path, cfg: LearnerConfig, reference: Reference | None = None):
    """A fresh policy and the fixed batch with π_old recomputed (and moved off π_θ)."""
    policy = TorchPolicy(load_model(model), cfg)
    seqs = sequences_from_groups(make_groups())
    recompute_old_logprobs(policy, seqs, cfg, 0, 1.0, reference=reference)
    for s in seqs:  # so that the clip branches matter
        s.old_logprobs = s.old_logprobs - 0.1 * torch.arange(len(s.response_ids))
    return policy, seqs


def _grads(policy: TorchPolicy) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None}


def _tis_grads(model: Path, cap: float | None, log_ratio: float) -> dict[str, torch.Tensor]:
    return _corrected_grads(model, TokenTIS(cap=cap) if cap else None, log_ratio)


def _corrected_grads(
    model: Path, correction, log_ratio: float, packing: bool = True
) -> dict[str, torch.Tensor]:
    cfg = _cfg(correction=correction, packing=packing)
    policy, seqs = _prepared(model, cfg)
    for s in seqs:  # the engine sampled with log π_rollout = log π_old − log_ratio
        s.rollout_logprobs = (s.old_logprobs - log_ratio).tolist()
    accumulate(policy, seqs, cfg, 0, 1.0, MAX_LEN)
    return _grads(policy)


@pytest.mark.parametrize("cap, expected", [(5.0, 2.0), (1.5, 1.5)])
def test_tis_scales_the_gradient_by_the_capped_ratio(
    tiny_model: Path, cap: float, expected: float
) -> None:
    """π_old / π_rollout = 2 on every token: the gradient is 2× (or the cap) the plain one."""
    plain = _tis_grads(tiny_model, None, math.log(2.0))
    weighted = _tis_grads(tiny_model, cap, math.log(2.0))
    assert plain.keys() == weighted.keys() and plain
    for name, g in plain.items():
        torch.testing.assert_close(weighted[name], expected * g, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    "correction", [TokenTIS(), SequenceTIS(), MaskedIS(level="sequence"), TwoSidedMask()]
)
def test_an_exact_engine_leaves_the_step_gradient_bit_for_bit(tiny_model: Path, correction) -> None:
    """π_behav == π_old (staleness 0, exact engine): the corrected gradient is DAPO's (in
    the same row layout: sequence-level corrections keep padded rows, learner.batch.use_packing)."""
    plain = _corrected_grads(tiny_model, None, 0.0, use_packing(_cfg(correction=correction)))
    corrected = _corrected_grads(tiny_model, correction, 0.0)
    assert plain.keys() == corrected.keys() and plain
    assert all(torch.equal(corrected[n], g) for n, g in plain.items())
    moved = _corrected_grads(tiny_model, correction, -1.8)  # ρ ≈ 6: every variant acts
    assert any(not torch.equal(moved[n], g) for n, g in plain.items())


def test_tis_without_rollout_logprobs_is_a_clear_error(tiny_model: Path) -> None:
    cfg = _cfg(correction=TokenTIS())
    policy, seqs = _prepared(tiny_model, cfg)
    seqs[0].rollout_logprobs = None
    with pytest.raises(ValueError, match="token_tis"):
        accumulate(policy, seqs, cfg, 0, 1.0, MAX_LEN)


def test_step_reports_engine_mismatch_on_current_version_tokens_and_policy_lag(
    tiny_model: Path,
) -> None:
    """Group 0 sampled by version 3 (the learner's), the rest by version 1: lag 2 there."""
    cfg = _cfg()
    groups = make_groups()
    policy = TorchPolicy(load_model(tiny_model), cfg)
    seqs = sequences_from_groups(groups)
    recompute_old_logprobs(policy, seqs, cfg, 0, 1.0)
    for k, group in enumerate(groups):
        for sample in group.samples:
            sample.policy_version = 3 if k == 0 else 1
    gaps = [
        abs(float(lp) - behav)
        for s in seqs[: len(groups[0].samples)]
        if s.rollout_logprobs is not None
        for lp, behav in zip(s.old_logprobs, s.rollout_logprobs.tolist(), strict=True)
    ]
    tokens = [len(s.response_ids) for s in seqs]
    metrics = train_step(policy, groups, cfg, 0, 1.0, MAX_LEN, version=3)
    assert metrics.mismatch_tokens == len(gaps)
    assert metrics.engine_mismatch == pytest.approx(sum(gaps) / len(gaps), rel=1e-5)
    stale_tokens = sum(tokens[len(groups[0].samples) :])
    assert metrics.policy_lag == pytest.approx(2 * stale_tokens / sum(tokens))
    assert metrics.policy_lag_max == 2 and metrics.is_weight_mean == 1.0


def _perturbed_model(model: Path):
    ref = load_model(model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return ref


def _perturbed_reference(model: Path) -> Reference:
    return Reference(_perturbed_model(model))


def test_kl_adds_exactly_coef_times_the_token_mean_k3_gradient(tiny_model: Path) -> None:
    reference, coef = _perturbed_reference(tiny_model), 0.3
    grads = {}
    for kl_coef in (0.0, coef):
        cfg = _cfg(kl_coef=kl_coef)
        policy, seqs = _prepared(tiny_model, cfg, reference)
        accumulate(policy, seqs, cfg, 0, 1.0, MAX_LEN)
        grads[kl_coef] = _grads(policy)

    cfg = _cfg(kl_coef=coef)
    policy, seqs = _prepared(tiny_model, cfg, reference)
    inputs = collate(seqs, 0)
    logprobs, _ = sequence_logprobs(policy, inputs, 1.0, cfg.batching.logprob_chunk_tokens)
    assert inputs.ref_logprobs is not None
    counts = loss_counts(seqs)
    kl = kl_k3(logprobs, inputs.ref_logprobs)
    agg_loss(
        kl, inputs.loss_mask, "token_mean", counts.tokens, counts.sequences, MAX_LEN
    ).backward()
    by_hand = _grads(policy)
    assert any(g.abs().max() > 1e-6 for g in by_hand.values())  # the KL gradient is not zero
    for name, g in by_hand.items():
        torch.testing.assert_close(
            grads[coef][name] - grads[0.0][name], coef * g, rtol=1e-4, atol=1e-6
        )


def test_kl_step_reports_kl_and_needs_a_reference(tiny_model: Path) -> None:
    cfg = _cfg(kl_coef=0.1)
    policy = TorchPolicy(load_model(tiny_model), cfg)
    with pytest.raises(ValueError, match="reference"):
        train_step(policy, make_groups(), cfg, 0, 1.0, MAX_LEN)
    metrics = train_step(
        policy, make_groups(), cfg, 0, 1.0, MAX_LEN, reference=_perturbed_reference(tiny_model)
    )
    # By hand: the k3 estimator exp(ref − logp) − (ref − logp) − 1 averaged over every
    # loss token, at the initial weights (one mini-batch), from plain forwards.
    start, ref = load_model(tiny_model), _perturbed_model(tiny_model)
    k3 = []
    with torch.no_grad():
        for group in make_groups():
            for sample in group.samples:
                args = (group.prompt_token_ids, sample.token_ids.tolist())
                delta = hand_logprobs(ref, *args)[0] - hand_logprobs(start, *args)[0]
                k3 += (delta.exp() - delta - 1).tolist()
    assert metrics.kl == pytest.approx(sum(k3) / len(k3), rel=1e-4)
    assert math.isfinite(metrics.loss)
    plain = train_step(
        TorchPolicy(load_model(tiny_model), _cfg()), make_groups(), _cfg(), 0, 1.0, MAX_LEN
    )
    assert plain.kl == 0.0


def _all_truncated(groups):
    for g in groups:
        for s in g.samples:
            s.truncated = True
    return groups


@pytest.mark.parametrize("engine", ["torch", "deepspeed"])
def test_fully_filtered_mini_batches_skip_the_optimizer(tiny_model: Path, engine: str) -> None:
    """No loss token left: no update at all (AdamW momentum and decay would still move θ)."""
    from learner.backends import build_policy

    cfg = LearnerConfig(
        engine=engine,
        dtype="float32",
        optimizer=OptimizerConfig(lr=1e-2),
        batching=BatchingConfig(micro_batch_tokens=64, mini_batch_responses=8),
    )
    policy = build_policy(tiny_model, cfg)
    first = train_step(policy, make_groups(), cfg, 0, 1.0, MAX_LEN)  # momentum is now non-zero
    assert first.updates == 2 and first.skipped_updates == 0
    before = {n: t.detach().clone() for n, t in policy.named_weights()}
    skipped = train_step(policy, _all_truncated(make_groups(seed=1)), cfg, 0, 1.0, MAX_LEN)
    assert skipped.updates == 0 and skipped.skipped_updates == 2
    for name, tensor in policy.named_weights():
        assert torch.equal(tensor, before[name]), name
    # Overlong filtering off: the same truncated batch trains.
    objective_off = cfg.objective.model_copy(update={"overlong_filtering": False})
    cfg_off = cfg.model_copy(update={"objective": objective_off})
    trained = train_step(policy, _all_truncated(make_groups(seed=1)), cfg_off, 0, 1.0, MAX_LEN)
    assert trained.updates == 2
    assert any(not torch.equal(t, before[n]) for n, t in policy.named_weights())


def test_step_reports_informative_groups_and_the_longest_quarters_loss_share(tiny_model):
    groups = make_groups()  # every group holds rewards of both signs
    for s in groups[0].samples:
        s.correct, s.reward = True, 1.0  # all correct: dynamic sampling would drop it
    policy = TorchPolicy(load_model(tiny_model), _cfg())
    metrics = train_step(policy, groups, _cfg(), 0, 1.0, MAX_LEN)
    assert metrics.informative_frac == 0.75
    lengths = sorted((len(s.token_ids) for g in groups for s in g.samples), reverse=True)
    assert metrics.longest_loss_share == pytest.approx(sum(lengths[:4]) / sum(lengths))
    per_seq = _cfg(loss_agg_mode="seq_mean_token_mean")
    assert train_step(policy, groups, per_seq, 0, 1.0, MAX_LEN).longest_loss_share == 0.25
