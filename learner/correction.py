"""Off-policy corrections for asynchronous DAPO: decoupled PPO (AReaL, arXiv 2505.24298).

The importance weight ρ = π_prox / π_behav (per token, no gradient) multiplies DAPO's
clipped term, so a response sampled versions ago, or by an engine with other kernels, is
reweighted to the learner's proximal policy instead of being trusted or thrown away. The
paper is synchronous and has none; where π_behav equals π_prox every weight is 1.0.
The weights (`token_tis`, `seq_tis`, `mis`, `mask`) and how they enter the loss:
docs/architecture.md, "Off-policy corrections".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from learner.config import (
    Correction,
    MaskedIS,
    NoCorrection,
    SequenceTIS,
    TokenTIS,
    TwoSidedMask,
)


def behaviour_log_ratio(prox: Tensor, behav: Tensor, logratio_clamp: float = 20.0) -> Tensor:
    """log ρ = log π_prox − log π_behav per token, clamped, without gradient."""
    return torch.clamp(prox - behav, -logratio_clamp, logratio_clamp).detach()


def sequence_log_ratio(
    prox: Tensor, behav: Tensor, mask: Tensor, logratio_clamp: float = 20.0
) -> Tensor:
    """log Π_t ρ_t over the `mask`ed tokens of each row, clamped, as `[B, 1]`."""
    diff = torch.where(mask.bool(), prox - behav, torch.zeros_like(prox))
    summed = diff.sum(dim=-1, keepdim=True)
    return torch.clamp(summed, -logratio_clamp, logratio_clamp).detach()


def tis_weights(prox: Tensor, behav: Tensor, cap: float, logratio_clamp: float = 20.0) -> Tensor:
    """Token-level truncated IS: `min(π_prox / π_behav, cap)` per token."""
    return torch.exp(behaviour_log_ratio(prox, behav, logratio_clamp)).clamp(max=cap)


def seq_tis_weights(
    prox: Tensor, behav: Tensor, mask: Tensor, cap: float, logratio_clamp: float = 20.0
) -> Tensor:
    """Sequence-level truncated IS: `min(Π_t ρ_t, cap)` on every position of the row."""
    weight = torch.exp(sequence_log_ratio(prox, behav, mask, logratio_clamp)).clamp(max=cap)
    return weight.expand_as(prox)


def masked_is_weights(
    prox: Tensor,
    behav: Tensor,
    mask: Tensor,
    low: float,
    high: float,
    level: Literal["token", "sequence"] = "token",
    logratio_clamp: float = 20.0,
) -> Tensor:
    """Masked IS: ρ where `low ≤ ρ ≤ high`, else 0 (per token, or per whole sequence)."""
    if level == "sequence":
        rho = torch.exp(sequence_log_ratio(prox, behav, mask, logratio_clamp)).expand_as(prox)
    else:
        rho = torch.exp(behaviour_log_ratio(prox, behav, logratio_clamp))
    inside = (rho >= low) & (rho <= high)
    return torch.where(inside, rho, torch.zeros_like(rho))


def two_sided_mask_weights(
    prox: Tensor, behav: Tensor, low: float, high: float, logratio_clamp: float = 20.0
) -> Tensor:
    """Two-sided masking: 1 where `low ≤ ρ ≤ high`, else 0, per token."""
    rho = torch.exp(behaviour_log_ratio(prox, behav, logratio_clamp))
    return ((rho >= low) & (rho <= high)).to(prox.dtype)


def correction_weights(
    spec: Correction | None, prox: Tensor, behav: Tensor, mask: Tensor, logratio_clamp: float
) -> Tensor | None:
    """The weights `[B, T]` of `spec` for the per-token loss; None when there is none."""
    match spec:
        case None | NoCorrection():
            return None
        case TokenTIS(cap=cap):
            return tis_weights(prox, behav, cap, logratio_clamp)
        case SequenceTIS(cap=cap):
            return seq_tis_weights(prox, behav, mask, cap, logratio_clamp)
        case MaskedIS(level=level, low=low, high=high):
            return masked_is_weights(prox, behav, mask, low, high, level, logratio_clamp)
        case TwoSidedMask(low=low, high=high):
            return two_sided_mask_weights(prox, behav, low, high, logratio_clamp)
    raise TypeError(f"unknown correction {spec!r}")


def weight_sums(weights: Tensor | None, mask: Tensor) -> tuple[float, float]:
    """(Σ weight, tokens with weight 0) over `mask`: the correction's metrics, summable."""
    m = mask.bool()
    if weights is None:
        return float(m.sum()), 0.0
    w = weights.detach()
    return float(w[m].sum()), float((w[m] == 0).sum())


@dataclass(frozen=True)
class OffPolicySums:
    """Sums over response tokens that make the engine-mismatch and policy-lag metrics."""

    mismatch: float = 0.0  # Σ |log π_behav − log π_prox| over same-version tokens
    mismatch_tokens: float = 0.0  # tokens sampled by the learner's own version
    lag: float = 0.0  # Σ (current version − the token's version)
    tokens: float = 0.0  # every token with engine log-probs


def mismatch_and_lag_sums(
    prox: Tensor, behav: Tensor, versions: Tensor, current_version: int
) -> OffPolicySums:
    """The off-policy sums over tokens (1-D tensors, one entry per response token).

    The engine mismatch is `|log π_behav − log π_prox|` averaged over the tokens sampled by
    the learner's own version (`versions == current_version`: the same weights, so any gap
    is the engine's); the policy lag is `current_version − version` averaged over all tokens.
    """
    same = versions == current_version
    gap = (prox.double() - behav.double()).abs()
    return OffPolicySums(
        mismatch=float(gap[same].sum()),
        mismatch_tokens=float(same.sum()),
        lag=float((current_version - versions).double().sum()),
        tokens=float(versions.numel()),
    )
