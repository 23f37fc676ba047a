"""Every number a learner step reports, against the same number computed by hand.

A small hand-built batch (two groups, one overlong-filtered response, one response whose
tokens span two policy versions) runs through the learner's step; the expected values
come from DAPO's formulas (../shared/DAPO.md) in plain Python and torch over a plain
forward of the same weights (`hand_logprobs`), never from the code under test. Every
expected value differs from the others, so a metric read from the wrong sum fails.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import pytest
import torch
from learner_fixtures import hand_logprobs

from learner.batch import sequences_from_groups
from learner.config import (
    BatchingConfig,
    Correction,
    LearnerConfig,
    MaskedIS,
    ObjectiveConfig,
    OptimizerConfig,
)
from learner.correction import OffPolicySums
from learner.dist import Single
from learner.model_io import load_model
from learner.step import accumulate, reduce_sums, train_step
from learner.step_metrics import StepMetrics, StepSums, report_sums
from learner.torch_policy import TorchPolicy
from services.common.types import Group, Sample

TEMPERATURE, MAX_LEN, VERSION = 0.7, 16, 2
EPS_LOW, EPS_HIGH, C = 0.2, 0.28, 3.0
REL = 1e-4


def _sample(tokens, reward, correct, version=VERSION, finish="stop", versions=()):
    return Sample(
        tokens,
        [],
        "",
        finish,
        version,
        reward,
        correct,
        truncated=finish == "length",
        token_versions=list(versions),
    )


def _groups() -> list[Group]:
    """Group a: one right, one wrong, one wrong and cut at L_max (overlong-filtered).
    Group b: both wrong, one also pays an overlong penalty (rewards differ, accuracy 0:
    not informative by DAPO's rule); its first response spans versions 1 and 2."""
    a = [
        _sample([2, 4, 6, 8], 1.0, True),
        _sample([9, 1], -1.0, False),
        _sample([5, 5, 3, 2, 1, 4], -1.5, False, version=1, finish="length"),
    ]
    b = [
        _sample([1, 2, 3], -1.0, False, version=1, versions=[1, 2, 2]),
        _sample([4, 4, 7, 8, 9], -1.25, False),
    ]
    return [
        Group("ga", "pa", "", [3, 5, 7], "", samples=a),
        Group("gb", "pb", "", [6, 2], "", samples=b),
    ]


def _advantages(rewards: list[float]) -> list[float]:
    """DAPO's Â = (R − mean) / std (sample std, + 1e-6 as the config's epsilon)."""
    mean, std = statistics.fmean(rewards), statistics.stdev(rewards)
    return [(r - mean) / (std + 1e-6) for r in rewards]


def _by_hand(model_path: Path):
    """Per response: (prompt, sample, advantage, log-probs, entropies) at the initial weights."""
    model = load_model(model_path)
    rows = []
    for group in _groups():
        advs = _advantages([s.reward for s in group.samples])
        for sample, adv in zip(group.samples, advs, strict=True):
            response = sample.token_ids.tolist()
            with torch.no_grad():
                lp, ent = hand_logprobs(model, group.prompt_token_ids, response, TEMPERATURE)
            rows.append((group.prompt_token_ids, sample, adv, lp.tolist(), ent.tolist()))
    return model, rows


def _cfg(correction: Correction | None = None) -> LearnerConfig:
    return LearnerConfig(
        engine="torch",
        dtype="float32",
        optimizer=OptimizerConfig(lr=1e-3),
        batching=BatchingConfig(micro_batch_tokens=16, mini_batch_responses=8),
        objective=ObjectiveConfig(clip_ratio_c=C, correction=correction),
    )


# Engine log-probs: log π_behav = log π_θ − δ, so the masked-IS weight ρ = e^δ is kept
# inside [0.5, 2] and zeroed outside (e^1 and e^-1 are outside).
BEHAV_DELTAS = [0.0, 0.3, -0.2, 1.0, -1.0, 0.5]


def test_train_step_reports_every_metric_as_computed_by_hand(tiny_model: Path) -> None:
    """r = 1 in a step's only mini-batch (π_old is the same weights): no token is clipped,
    the loss is Σ w·(−Â) / N, and the gradient is that of Σ w·(−Â)·r / N."""
    cfg = _cfg(correction=MaskedIS(level="token", low=0.5, high=2.0))
    model, rows = _by_hand(tiny_model)
    groups, deltas = _groups(), iter(BEHAV_DELTAS * 5)
    hand_loss = torch.zeros((), dtype=torch.float64)
    weights, entropies, gaps, lags, lengths, loss_lengths = [], [], [], [], [], []
    n_loss = sum(len(lp) for _, s, _, lp, _ in rows if not s.truncated)
    for group in groups:  # the engine's log-probs, δ below the learner's
        for sample in group.samples:
            prompt, _, adv, lp, ent = rows.pop(0)
            d = [next(deltas) for _ in lp]
            sample.logprobs = [x - dx for x, dx in zip(lp, d, strict=True)]
            versions = sample.token_versions.tolist() or [sample.policy_version] * len(lp)
            gaps += [abs(dx) for dx, v in zip(d, versions, strict=True) if v == VERSION]
            lags += [VERSION - v for v in versions]
            lengths.append(len(lp))
            if sample.truncated:
                continue
            w = [math.exp(dx) if 0.5 <= math.exp(dx) <= 2.0 else 0.0 for dx in d]
            weights += w
            entropies += ent
            loss_lengths.append(len(lp))
            live, _ = hand_logprobs(model, prompt, sample.token_ids.tolist(), TEMPERATURE)
            ratio = torch.exp(live - live.detach())
            hand_loss = hand_loss + (torch.tensor(w) * -adv * ratio).sum() / n_loss
    hand_loss.backward()
    grad_norm = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters()))
    rewards = [s.reward for g in groups for s in g.samples]

    policy = TorchPolicy(load_model(tiny_model), cfg)
    m = train_step(policy, groups, cfg, 0, TEMPERATURE, MAX_LEN, version=VERSION)

    assert (n_loss, sum(lengths)) == (14, 20)  # the batch is the one described above
    assert m.loss == pytest.approx(float(hand_loss.detach()), rel=REL)
    assert (m.clip_frac_high, m.clip_frac_low, m.clip_frac_dual) == (0.0, 0.0, 0.0)
    assert m.entropy == pytest.approx(sum(entropies) / n_loss, rel=REL)
    assert m.grad_norm == pytest.approx(grad_norm, rel=REL)
    assert m.lr == pytest.approx(cfg.optimizer.lr / cfg.optimizer.warmup_steps)
    assert m.tokens == sum(lengths) == 20
    assert m.response_length == pytest.approx(20 / 5)
    assert m.response_length_max == 6
    assert m.truncated_frac == pytest.approx(1 / 5)
    assert m.longest_loss_share == pytest.approx(max(loss_lengths) / sum(loss_lengths))
    assert m.informative_frac == pytest.approx(1 / 2)
    assert m.reward_mean == pytest.approx(sum(rewards) / 5)
    assert m.accuracy == pytest.approx(1 / 5)
    assert m.mismatch_tokens == len(gaps) == 13
    assert m.engine_mismatch == pytest.approx(sum(gaps) / len(gaps), rel=REL)
    assert m.policy_lag == pytest.approx(sum(lags) / len(lags))
    assert m.policy_lag_max == 1
    assert m.is_weight_mean == pytest.approx(sum(weights) / n_loss, rel=REL)
    assert m.is_masked_frac == pytest.approx(weights.count(0.0) / n_loss)
    assert m.kl == 0.0
    assert (m.updates, m.skipped_updates) == (1, 0)
    prompt_and_response = sum(len(g.prompt_token_ids) * len(g.samples) for g in groups) + 20
    assert m.tokens_per_s * m.seconds == pytest.approx(prompt_and_response)


# log π_old = log π_θ − δ per token, so r = e^δ: chosen to land on each side of each bound.
OLD_DELTAS = {
    0: [0.5, 0.1, -0.5, 0.0],  # Â > 0: r 1.65 clipped high; 1.11; 0.61 (no clip for Â > 0); 1
    1: [-0.5, 1.5],  # Â < 0: r 0.61 clipped low; 4.48 > c dual-clipped
    2: [1.5] * 6,  # overlong-filtered: would be dual-clipped, must not count
    3: [0.1, -0.1, 0.2],  # Â > 0: r 1.11, 0.90, 1.22: none clipped
    4: [-0.3, 2.0, 0.05, -0.25, 0.1],  # Â < 0: low, dual, none, low (0.78), none
}


def _hand_token_loss(r: float, adv: float) -> float:
    """DAPO's −min(r Â, clip(r, 1 − ε_low, 1 + ε_high) Â), capped at −Â·c when Â < 0."""
    loss = -min(r * adv, min(max(r, 1 - EPS_LOW), 1 + EPS_HIGH) * adv)
    return min(loss, -adv * C) if adv < 0 else loss


def test_step_sums_give_clip_fractions_loss_and_entropy_by_hand(tiny_model: Path) -> None:
    """Known π_old: tokens past each clip bound, the dual clip included, summed over
    micro-batches by `accumulate` and over ranks by the step's own reduction."""
    cfg = _cfg()
    _, rows = _by_hand(tiny_model)
    seqs = sequences_from_groups(_groups())
    losses, entropies, high, low, dual = [], [], 0, 0, 0
    for k, (seq, (_, sample, adv, lp, ent)) in enumerate(zip(seqs, rows, strict=True)):
        seq.old_logprobs = torch.tensor([x - d for x, d in zip(lp, OLD_DELTAS[k], strict=True)])
        if sample.truncated:
            continue
        for d, e in zip(OLD_DELTAS[k], ent, strict=True):
            r = math.exp(d)
            losses.append(_hand_token_loss(r, adv))
            entropies.append(e)
            high += adv > 0 and r > 1 + EPS_HIGH
            low += adv < 0 and r < 1 - EPS_LOW
            dual += adv < 0 and r > C
    assert (len(losses), high, low, dual) == (14, 1, 3, 2)  # the batch described above

    policy = TorchPolicy(load_model(tiny_model), cfg)
    sums = accumulate(policy, seqs, cfg, 0, TEMPERATURE, MAX_LEN)
    m = StepMetrics()
    report_sums(m, reduce_sums(sums, Single()))

    assert m.loss == pytest.approx(sum(losses) / 14, rel=REL)
    assert m.clip_frac_high == pytest.approx(1 / 14)
    assert m.clip_frac_low == pytest.approx(3 / 14)
    assert m.clip_frac_dual == pytest.approx(2 / 14)
    assert m.entropy == pytest.approx(sum(entropies) / 14, rel=REL)
    assert (m.is_weight_mean, m.is_masked_frac, m.kl) == (1.0, 0.0, 0.0)
    assert float(sums.clip.tokens) == 14.0


def test_step_sums_cross_ranks_as_one_vector_and_come_back_by_name() -> None:
    from learner.algorithm import ClipStats

    values = [float(v) for v in range(1, 14)]
    sums = StepSums(
        clip=ClipStats(*(torch.tensor(v, dtype=torch.float64) for v in values[:4])),
        loss=values[4],
        entropy=values[5],
        kl=values[6],
        is_weight=values[7],
        is_masked=values[8],
        off_policy=OffPolicySums(*values[9:]),
    )
    flat = sums.to_tensor()
    assert flat.dtype == torch.float64 and sorted(flat.tolist()) == values
    back = StepSums.from_tensor(flat)
    assert back.to_tensor().tolist() == flat.tolist()
    assert (back.loss, back.entropy, back.kl, back.is_weight, back.is_masked) == (5, 6, 7, 8, 9)
    assert back.off_policy == sums.off_policy
    clip = back.clip
    assert [
        float(clip.clipped_high),
        float(clip.clipped_low),
        float(clip.dual_clipped),
        float(clip.tokens),
    ] == [1, 2, 3, 4]
    doubled = StepSums.from_tensor((sums + sums).to_tensor())
    assert doubled.to_tensor().tolist() == [2 * v for v in flat.tolist()]
