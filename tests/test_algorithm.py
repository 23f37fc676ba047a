"""The DAPO loss functions against hand-computed values and torch.autograd."""

from __future__ import annotations

import math

import pytest
import torch
from learner_fixtures import EXACT

from learner.algorithm import (
    ClipStats,
    agg_loss,
    group_advantages,
    kl_k3,
    longest_loss_share,
    masked_mean,
    overlong_filter_mask,
    per_token_loss,
    policy_loss,
    token_logprobs,
)

F64 = torch.float64

# One token per branch, ε_low 0.2, ε_high 0.28, dual-clip c = 3 (ratio r, advantage Â):
RATIOS = [1.1, 1.5, 0.5, 0.5, 1.5, 4.0, 0.9, 1.3]
ADVS = [1.0, 1.0, 1.0, -1.0, -1.0, -1.0, -2.0, 0.0]
# Â>0 inside | Â>0 above 1+ε_high (clipped) | Â>0 below 1-ε_low (not clipped)
# Â<0 below 1-ε_low (clipped) | Â<0 above 1+ε_high (not clipped) | Â<0 above c (dual-clip)
# Â<0 inside | Â=0
LOSS_DUAL = [-1.1, -1.28, -0.5, 0.8, 1.5, 3.0, 1.8, 0.0]
LOSS_NO_DUAL = [-1.1, -1.28, -0.5, 0.8, 1.5, 4.0, 1.8, 0.0]
# d loss / d logp = -Â·r where the unclipped branch is active, 0 where any clip is.
GRAD_DUAL = [-1.1, 0.0, -0.5, 0.0, 1.5, 0.0, 1.8, 0.0]


def _branch_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    logp = torch.tensor(RATIOS, dtype=F64).log().unsqueeze(0).requires_grad_(True)
    old = torch.zeros_like(logp)
    adv = torch.tensor(ADVS, dtype=F64).unsqueeze(0)
    return logp, old, adv, torch.ones_like(adv, dtype=torch.bool)


def test_policy_loss_each_branch_with_dual_clip() -> None:
    logp, old, adv, mask = _branch_inputs()
    loss, stats = policy_loss(logp, old, adv, mask, 0.2, 0.28, clip_ratio_c=3.0)
    torch.testing.assert_close(loss, torch.tensor([LOSS_DUAL], dtype=F64), **EXACT)
    assert (stats.clipped_high.item(), stats.clipped_low.item()) == (1.0, 1.0)
    assert (stats.dual_clipped.item(), stats.tokens.item()) == (1.0, 8.0)
    assert stats.fractions() == {
        "clip_frac_high": 0.125,
        "clip_frac_low": 0.125,
        "clip_frac_dual": 0.125,
    }


def test_policy_loss_without_dual_clip() -> None:
    logp, old, adv, mask = _branch_inputs()
    loss, stats = policy_loss(logp, old, adv, mask, 0.2, 0.28)
    torch.testing.assert_close(loss, torch.tensor([LOSS_NO_DUAL], dtype=F64), **EXACT)
    assert stats.dual_clipped.item() == 0.0


def test_clipped_tokens_get_zero_gradient() -> None:
    logp, old, adv, mask = _branch_inputs()
    loss, _ = policy_loss(logp, old, adv, mask, 0.2, 0.28, clip_ratio_c=3.0)
    loss.sum().backward()
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, torch.tensor([GRAD_DUAL], dtype=F64), **EXACT)


def test_clip_stats_count_only_masked_tokens_and_add_up() -> None:
    logp, old, adv, _ = _branch_inputs()
    mask = torch.tensor([[1, 0, 1, 1, 1, 0, 1, 1]], dtype=torch.bool)
    _, stats = policy_loss(logp, old, adv, mask, 0.2, 0.28, clip_ratio_c=3.0)
    assert (stats.clipped_high.item(), stats.clipped_low.item()) == (0.0, 1.0)
    assert (stats.dual_clipped.item(), stats.tokens.item()) == (0.0, 6.0)
    total = stats + stats
    assert total.tokens.item() == 12.0 and total.fractions()["clip_frac_low"] == 2 / 12
    empty = ClipStats.zero()
    assert empty.fractions()["clip_frac_high"] == 0.0


def test_log_ratio_clamp_bounds_ratio_and_stops_gradient() -> None:
    logp = torch.tensor([[30.0, 10.0]], dtype=F64, requires_grad=True)
    old = torch.zeros_like(logp)
    adv = torch.tensor([[-1.0, -1.0]], dtype=F64)
    loss, _ = policy_loss(logp, old, adv, torch.ones_like(adv), 0.2, 0.28, logratio_clamp=20.0)
    torch.testing.assert_close(loss, torch.tensor([[math.exp(20.0), math.exp(10.0)]], dtype=F64))
    loss.sum().backward()
    assert logp.grad is not None
    assert logp.grad[0, 0].item() == 0.0 and logp.grad[0, 1].item() == pytest.approx(math.exp(10))


def test_policy_loss_gradcheck_away_from_kinks() -> None:
    ratios = torch.tensor([[1.05, 1.6, 0.6, 0.95], [0.5, 1.1, 1.4, 5.0]], dtype=F64)
    adv = torch.tensor([[1.0, 0.7, 1.3, -0.4], [-1.2, -0.3, -2.0, -1.0]], dtype=F64)
    old = torch.randn(2, 4, dtype=F64)
    logp = (old + ratios.log()).requires_grad_(True)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)

    def f(lp: torch.Tensor) -> torch.Tensor:
        loss, _ = policy_loss(lp, old, adv, mask, 0.2, 0.28, clip_ratio_c=3.0)
        return agg_loss(loss, mask, "token_mean")

    assert torch.autograd.gradcheck(f, (logp,))


def test_group_advantages_values_and_std_switch() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, -1.0, 1.0, -1.0]])
    # group 1: mean 0.25, unbiased std sqrt(0.75 / 3) = 0.5; group 2: mean 0, std sqrt(4/3)
    s = math.sqrt(4 / 3)
    expected = torch.tensor([[1.5, -0.5, -0.5, -0.5], [1 / s, -1 / s, 1 / s, -1 / s]])
    torch.testing.assert_close(group_advantages(rewards, epsilon=0.0), expected)
    no_std = group_advantages(rewards, epsilon=0.0, norm_by_std=False)
    torch.testing.assert_close(
        no_std, torch.tensor([[0.75, -0.25, -0.25, -0.25], [1, -1, 1, -1.0]])
    )
    eps = group_advantages(rewards, epsilon=0.5)
    torch.testing.assert_close(eps[0], torch.tensor([0.75, -0.25, -0.25, -0.25]))


def test_group_advantages_equal_rewards_and_singletons_are_zero_not_nan() -> None:
    cases = (torch.ones(2, 4), torch.full((1, 16), 0.1), torch.tensor([[0.7]]))
    for rewards in cases:
        for norm in (True, False):
            for eps in (0.0, 1e-6):
                adv = group_advantages(rewards, epsilon=eps, norm_by_std=norm)
                assert torch.equal(adv, torch.zeros_like(rewards))
    assert group_advantages(torch.tensor([[1, 0]])).dtype == torch.float32


def test_token_mean_weighs_every_token_equally_seq_mean_does_not() -> None:
    # A long (4 tokens) and a short (1 token) response; loss = logp so grad = per-token weight.
    x = torch.zeros(2, 4, dtype=F64, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    agg_loss(x, mask, "token_mean").backward()
    assert x.grad is not None
    torch.testing.assert_close(x.grad, mask.to(F64) / 5, **EXACT)

    x.grad = None
    agg_loss(x, mask, "seq_mean_token_mean").backward()
    expected = torch.tensor([[1 / 8, 1 / 8, 1 / 8, 1 / 8], [1 / 2, 0, 0, 0]], dtype=F64)
    torch.testing.assert_close(x.grad, expected, **EXACT)
    assert x.grad[1, 0] == 4 * x.grad[0, 0]


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_longest_loss_share_is_the_gradient_weight_agg_loss_gives_them(mode) -> None:
    # Responses of 1..8 loss tokens and one masked out: the longest quarter (2 of 8) is
    # the 8- and 7-token ones; their share of Σ |∂loss/∂token| is what the metric reports.
    lengths = [3, 8, 1, 7, 2, 5, 4, 6, 0]
    mask = torch.tensor([[t < n for t in range(8)] for n in lengths])
    x = torch.ones(len(lengths), 8, dtype=F64, requires_grad=True)
    agg_loss(x, mask, mode, norm_len=8).backward()
    per_seq = x.grad.sum(dim=-1)
    expected = float(per_seq[[1, 3]].sum() / per_seq.sum())
    assert longest_loss_share(lengths, mode) == pytest.approx(expected, abs=1e-12)
    assert longest_loss_share(lengths, mode) == (0.25 if mode == "seq_mean_token_mean" else 15 / 36)
    assert longest_loss_share([0, 0], mode) == 0.0


def test_agg_loss_values_and_explicit_divisors() -> None:
    loss = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 100.0, 100.0, 100.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)
    assert agg_loss(loss, mask, "token_mean").item() == 10 / 4
    assert agg_loss(loss, mask, "token_mean", global_token_count=8).item() == 10 / 8
    assert agg_loss(loss, mask, "token_mean", torch.tensor(5.0)).item() == 2.0
    assert agg_loss(loss, mask, "seq_mean_token_mean").item() == (2 + 4) / 2
    assert agg_loss(loss, mask, "seq_mean_token_mean", global_seq_count=3).item() == 2.0
    got = agg_loss(loss, mask, "seq_mean_token_sum_norm", norm_len=10)
    assert got.item() == 10 / (2 * 10)
    with pytest.raises(ValueError, match="norm_len"):
        agg_loss(loss, mask, "seq_mean_token_sum_norm")
    with pytest.raises(ValueError, match="unknown"):
        agg_loss(loss, mask, "sum")  # type: ignore[arg-type]


def test_agg_loss_ignores_nan_in_masked_positions_and_empty_masks() -> None:
    loss = torch.tensor([[1.0, float("nan")]], dtype=F64, requires_grad=True)
    mask = torch.tensor([[True, False]])
    out = agg_loss(loss, mask, "token_mean")
    out.backward()
    assert out.item() == 1.0 and loss.grad is not None and loss.grad[0, 1].item() == 0.0
    empty = torch.zeros_like(mask)
    for mode in ("token_mean", "seq_mean_token_mean"):
        assert agg_loss(loss, empty, mode).item() == 0.0


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_agg_loss_gradcheck(mode: str) -> None:
    loss = torch.randn(3, 5, dtype=F64, requires_grad=True)
    mask = torch.rand(3, 5) > 0.3
    assert torch.autograd.gradcheck(lambda x: agg_loss(x, mask, mode, norm_len=7), (loss,))


def _micro_batch_setup(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    b, t, v = 6, 9, 11
    lengths = torch.tensor([9, 1, 5, 2, 8, 3])
    mask = torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)
    return {
        "logits": torch.randn(b, t, v, dtype=F64, generator=g),
        "tokens": torch.randint(0, v, (b, t), generator=g),
        "old": torch.randn(b, t, dtype=F64, generator=g) * 0.3 - 2.5,
        "adv": torch.randn(b, 1, dtype=F64, generator=g).expand(b, t),
        "mask": mask,
    }


def _loss_and_grad(d: dict[str, torch.Tensor], rows: list[list[int]], mode: str, counts: dict):
    logits = d["logits"].clone().requires_grad_(True)
    total = torch.zeros((), dtype=F64)
    for idx in rows:
        lp, _ = token_logprobs(logits[idx], d["tokens"][idx], temperature=0.8)
        m = d["mask"][idx]
        loss_mat, _ = policy_loss(lp, d["old"][idx], d["adv"][idx], m, 0.2, 0.28, 3.0)
        loss = agg_loss(loss_mat, m, mode, norm_len=9, **counts)
        loss.backward()  # one backward per micro-batch: gradients accumulate
        total = total + loss.detach()
    return total, logits.grad


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_micro_batch_losses_over_global_count_sum_to_full_batch(mode: str) -> None:
    d = _micro_batch_setup(0)
    counts = {"global_token_count": int(d["mask"].sum()), "global_seq_count": 6}
    full_loss, full_grad = _loss_and_grad(d, [list(range(6))], mode, {})
    micro = [[0, 3], [1], [2, 4, 5]]
    micro_loss, micro_grad = _loss_and_grad(d, micro, mode, counts)
    torch.testing.assert_close(micro_loss, full_loss, **EXACT)
    torch.testing.assert_close(micro_grad, full_grad, **EXACT)
    # Dividing by each micro-batch's own count (then averaging) is not the same loss.
    local_loss, _ = _loss_and_grad(d, micro, mode, {})
    assert abs(local_loss.item() / 3 - full_loss.item()) > 1e-3


def test_token_logprobs_values_temperature_and_entropy() -> None:
    logits = torch.tensor([[[2.0, 0.0, -1.0], [0.5, 0.5, 0.5]]])
    tokens = torch.tensor([[0, 2]])
    lp, ent = token_logprobs(logits, tokens, temperature=0.5)
    scaled = logits.double() / 0.5
    p = scaled.exp() / scaled.exp().sum(-1, keepdim=True)
    expected_lp = torch.stack([p[0, 0, 0].log(), p[0, 1, 2].log()]).float().unsqueeze(0)
    expected_ent = (-(p * p.log()).sum(-1)).float()
    torch.testing.assert_close(lp, expected_lp)
    torch.testing.assert_close(ent, expected_ent)
    assert ent[0, 1].item() == pytest.approx(math.log(3))
    assert lp.dtype == torch.float32 and not ent.requires_grad
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(logits, tokens, temperature=0.0)


def test_token_logprobs_upcasts_bf16_and_gradcheck() -> None:
    logits = torch.randn(2, 3, 7, dtype=torch.bfloat16)
    tokens = torch.randint(0, 7, (2, 3))
    lp, _ = token_logprobs(logits, tokens)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp, token_logprobs(logits.float(), tokens)[0])
    x = torch.randn(2, 3, 7, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda z: token_logprobs(z, tokens, 0.7)[0], (x,))


def test_kl_k3_value_and_gradient() -> None:
    logp = torch.tensor([[0.0, -1.0, -2.0]], dtype=F64, requires_grad=True)
    ref = torch.tensor([[math.log(2.0), -1.0, -3.0]], dtype=F64)
    kl = kl_k3(logp, ref)
    x = ref - logp.detach()
    torch.testing.assert_close(kl, x.exp() - x - 1, **EXACT)
    assert kl[0, 1].item() == 0.0 and (kl >= 0).all()
    kl.sum().backward()
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, 1 - x.exp(), **EXACT)  # d/dlogp (e^x - x - 1)
    assert torch.autograd.gradcheck(lambda z: kl_k3(z, ref), (logp,))


def test_per_token_loss_applies_weights_and_kl() -> None:
    logp, old, adv, mask = _branch_inputs()
    w = torch.full_like(adv, 0.5)
    kl = torch.full_like(adv, 2.0)
    policy, _ = policy_loss(logp, old, adv, mask, 0.2, 0.28, 3.0)
    loss = per_token_loss(policy, is_weights=w, kl=kl, kl_coef=0.1)
    expected = torch.tensor([LOSS_DUAL], dtype=F64) * 0.5 + 0.2
    torch.testing.assert_close(loss, expected, **EXACT)
    plain = per_token_loss(policy, kl=kl)  # kl_coef 0: no KL
    torch.testing.assert_close(plain, torch.tensor([LOSS_DUAL], dtype=F64), **EXACT)


def test_overlong_filter_mask_and_masked_mean() -> None:
    response = torch.tensor([[0, 1, 1], [0, 1, 0], [1, 1, 1]], dtype=torch.bool)
    truncated = torch.tensor([False, True, False])
    got = overlong_filter_mask(response, truncated)
    assert torch.equal(got, torch.tensor([[0, 1, 1], [0, 0, 0], [1, 1, 1]], dtype=torch.bool))
    values = torch.tensor([[9.0, 1.0, 2.0], [9.0, 9.0, 9.0], [3.0, 4.0, 5.0]])
    assert masked_mean(values, got).item() == 3.0
    assert masked_mean(values, torch.zeros_like(got)).item() == 0.0
