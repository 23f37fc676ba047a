"""The off-policy corrections against hand-computed weights, their gradients, and the
exactness promise: with π_behav == π_prox the corrected loss is DAPO's, bit for bit."""

from __future__ import annotations

import math

import pytest
import torch
from learner_fixtures import EXACT

from learner.algorithm import agg_loss, per_token_loss, policy_loss
from learner.config import MaskedIS, NoCorrection, SequenceTIS, TokenTIS, TwoSidedMask
from learner.correction import (
    OffPolicySums,
    correction_weights,
    masked_is_weights,
    mismatch_and_lag_sums,
    seq_tis_weights,
    tis_weights,
    two_sided_mask_weights,
    weight_sums,
)

F64 = torch.float64
LN = math.log


def _prox(ratios: list[list[float]]) -> torch.Tensor:
    """log π_prox such that ρ = π_prox / π_behav is `ratios` with log π_behav = 0."""
    return torch.tensor([[LN(r) for r in row] for row in ratios], dtype=F64)


RHO = [[3.0, 0.5, 1.0, 0.25], [2.0, 1.5, 1.0, 4.0]]
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)  # last token: padding


def _w(ratios: list[list[float]]) -> torch.Tensor:
    return torch.tensor(ratios, dtype=F64)


def test_token_tis_truncates_each_token_at_the_cap_without_gradient() -> None:
    prox = _prox(RHO).requires_grad_(True)
    w = tis_weights(prox, torch.zeros_like(prox), cap=2.0)
    torch.testing.assert_close(w, _w([[2.0, 0.5, 1.0, 0.25], [2.0, 1.5, 1.0, 2.0]]), **EXACT)
    assert not w.requires_grad


def test_sequence_tis_weighs_every_token_by_the_capped_product() -> None:
    prox = _prox(RHO)
    # Row 0: 3 · 0.5 · 1 · 0.25 = 0.375. Row 1 (masked 4.0 left out): 2 · 1.5 · 1 = 3 → cap 2.
    w = seq_tis_weights(prox, torch.zeros_like(prox), MASK, cap=2.0)
    torch.testing.assert_close(w, _w([[0.375] * 4, [2.0] * 4]), **EXACT)


def test_masked_is_zeroes_tokens_outside_the_band_and_keeps_the_ratio_inside() -> None:
    prox, behav = _prox(RHO), torch.zeros(2, 4, dtype=F64)
    w = masked_is_weights(prox, behav, MASK, low=0.5, high=2.0, level="token")
    torch.testing.assert_close(w, _w([[0.0, 0.5, 1.0, 0.0], [2.0, 1.5, 1.0, 0.0]]), **EXACT)
    # Per sequence: 0.375 < 0.5 rejects all of row 0; row 1's product 3 > 2 rejects it too.
    seq = masked_is_weights(prox, behav, MASK, low=0.25, high=2.0, level="sequence")
    torch.testing.assert_close(seq, _w([[0.375] * 4, [0.0] * 4]), **EXACT)


def test_two_sided_mask_keeps_weight_one_inside_the_band() -> None:
    prox = _prox(RHO)
    w = two_sided_mask_weights(prox, torch.zeros_like(prox), low=0.5, high=3.5)
    torch.testing.assert_close(w, _w([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 0.0]]), **EXACT)


def test_weights_scale_the_gradient_of_the_clipped_term() -> None:
    """r = 1 on every token (no clip active): d loss / d log π_θ = −Â · w exactly."""
    logp = torch.zeros(1, 3, dtype=F64, requires_grad=True)
    adv = torch.tensor([[1.0, -1.0, 2.0]], dtype=F64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    w = tis_weights(_prox([[3.0, 0.5, 1.0]]), torch.zeros(1, 3, dtype=F64), cap=2.0)
    policy, _ = policy_loss(logp, logp.detach(), adv, mask, 0.2, 0.28)
    loss = per_token_loss(policy, is_weights=w)
    loss.sum().backward()
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, torch.tensor([[-2.0, 0.5, -2.0]], dtype=F64), **EXACT)


def test_a_masked_token_contributes_no_gradient() -> None:
    logp = torch.tensor([[0.1, -0.2]], dtype=F64, requires_grad=True)
    old = torch.zeros(1, 2, dtype=F64)
    w = two_sided_mask_weights(_prox([[10.0, 1.0]]), torch.zeros(1, 2, dtype=F64), 0.5, 5.0)
    mask = torch.ones(1, 2, dtype=torch.bool)
    policy, _ = policy_loss(logp, old, torch.ones(1, 2, dtype=F64), mask, 0.2, 0.28)
    loss = per_token_loss(policy, is_weights=w)
    loss.sum().backward()
    assert logp.grad is not None
    assert logp.grad[0, 0].item() == 0.0 and logp.grad[0, 1].item() == -math.exp(-0.2)


SPECS = [
    TokenTIS(cap=2.0),
    SequenceTIS(cap=2.0),
    MaskedIS(level="token"),
    MaskedIS(level="sequence"),
    TwoSidedMask(),
]


def _loss_and_grad(
    spec: object, behav_shift: float, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logp = (-2.0 * torch.rand(4, 9, generator=gen)).requires_grad_(True)
    old = logp.detach() + 0.3 * torch.randn(4, 9, generator=gen)  # some tokens clip
    adv = torch.randn(4, 1, generator=gen).expand(4, 9)
    mask = torch.rand(4, 9, generator=gen) > 0.2
    behav = old + behav_shift
    w = correction_weights(spec, old, behav, mask, 20.0)  # type: ignore[arg-type]
    policy, _ = policy_loss(logp, old, adv, mask, 0.2, 0.28, 3.0)
    mat = per_token_loss(policy, is_weights=w)
    loss = agg_loss(mat, mask, "token_mean")
    loss.backward()
    assert logp.grad is not None
    return loss.detach(), logp.grad


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.kind}-{getattr(s, 'level', '')}")
def test_an_exact_engine_gives_dapo_bit_for_bit(spec: object) -> None:
    plain_loss, plain_grad = _loss_and_grad(NoCorrection(), 0.0)
    loss, grad = _loss_and_grad(spec, 0.0)
    assert torch.equal(loss, plain_loss) and torch.equal(grad, plain_grad)
    # ... and the comparison can fail: a behaviour policy 1.8 nats away (ρ ≈ 6) changes both.
    shifted_loss, shifted_grad = _loss_and_grad(spec, -1.8)
    assert not torch.equal(shifted_loss, plain_loss)
    assert not torch.equal(shifted_grad, plain_grad)


def test_no_correction_gives_no_weights() -> None:
    x = torch.zeros(1, 2)
    assert correction_weights(NoCorrection(), x, x, x.bool(), 20.0) is None
    assert correction_weights(None, x, x, x.bool(), 20.0) is None


def test_weight_sums_count_over_the_mask() -> None:
    w = _w([[2.0, 0.0, 1.0], [0.0, 0.5, 3.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    assert weight_sums(w, mask) == (3.5, 2.0)
    assert weight_sums(None, mask) == (5.0, 0.0)


def test_mismatch_counts_same_version_tokens_and_lag_counts_all() -> None:
    prox = torch.tensor([-1.0, -2.0, -3.0, -0.5])
    behav = torch.tensor([-1.5, -2.0, -2.0, -0.5])
    versions = torch.tensor([5, 4, 5, 3])
    sums = mismatch_and_lag_sums(prox, behav, versions, current_version=5)
    # |Δ| over versions == 5: 0.5 + 1.0; lag: 0 + 1 + 0 + 2 over 4 tokens.
    assert sums == OffPolicySums(mismatch=1.5, mismatch_tokens=2.0, lag=3.0, tokens=4.0)
