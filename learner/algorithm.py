"""DAPO's objective as pure functions of tensors (arXiv 2503.14476, eq. 8 and section 3).

`group_advantages`, `policy_loss`, `agg_loss`, `overlong_filter_mask` and `token_logprobs`
compute the paper's terms; `per_token_loss` combines them with the optional corrections.
Every loss is a loss to minimise (−J); `[B, T]` is B sequences by T token positions.
Which function computes which term, and the departures from the paper (unbiased std + ε,
dual-clip and log-ratio clamp, off-policy weights, k3 KL, GRPO / Dr.GRPO aggregation):
docs/architecture.md, "The DAPO loss".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from learner.config import LossAggMode

Count = int | float | Tensor


def group_advantages(rewards: Tensor, epsilon: float = 1e-6, norm_by_std: bool = True) -> Tensor:
    """Group-relative advantages over the last dim: `(R - mean) / (std + epsilon)`.

    `rewards` is `[..., G]` (the G responses of one prompt on the last dim); the result has
    the same shape (float32 for integer rewards) and is later broadcast to every token of
    its response. Computed in float64. A group of equal rewards (a group of one included)
    gets exactly 0 whatever `epsilon`, never rounding noise or NaN.
    """
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    r = rewards.to(torch.float64)
    centred = r - r.mean(dim=-1, keepdim=True)
    if norm_by_std:
        correction = 1 if r.shape[-1] > 1 else 0
        centred = centred / (r.std(dim=-1, keepdim=True, correction=correction) + epsilon)
    all_equal = (r == r[..., :1]).all(dim=-1, keepdim=True)
    return torch.where(all_equal, torch.zeros_like(centred), centred).to(out_dtype)


@dataclass(frozen=True)
class ClipStats:
    """Token counts (detached sums over the mask) so micro-batches and ranks add up exactly.

    `clipped_high`: Â > 0 and r > 1 + ε_high (the upper clip is active, no gradient).
    `clipped_low`: Â < 0 and r < 1 − ε_low (the lower clip is active, no gradient).
    `dual_clipped`: Â < 0 and r > c (the dual-clip bound −Â·c is active, no gradient).
    """

    clipped_high: Tensor
    clipped_low: Tensor
    dual_clipped: Tensor
    tokens: Tensor

    @classmethod
    def zero(cls) -> ClipStats:
        """No token yet: the start of a sum over micro-batches."""
        return cls(*(torch.zeros((), dtype=torch.float64) for _ in range(4)))

    def __add__(self, other: ClipStats) -> ClipStats:
        return ClipStats(
            self.clipped_high + other.clipped_high,
            self.clipped_low + other.clipped_low,
            self.dual_clipped + other.dual_clipped,
            self.tokens + other.tokens,
        )

    def fractions(self) -> dict[str, float]:
        """Fractions of loss tokens per clip kind (0.0 when there are no tokens)."""
        n = max(float(self.tokens), 1.0)
        return {
            "clip_frac_high": float(self.clipped_high) / n,
            "clip_frac_low": float(self.clipped_low) / n,
            "clip_frac_dual": float(self.dual_clipped) / n,
        }


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    eps_low: float,
    eps_high: float,
    clip_ratio_c: float | None = None,
    logratio_clamp: float = 20.0,
) -> tuple[Tensor, ClipStats]:
    """Per-token clipped surrogate loss `−min(r Â, clip(r, 1−ε_low, 1+ε_high) Â)`, `[B, T]`.

    With `clip_ratio_c` (> 1), tokens with Â < 0 have their loss capped at `−Â·c`, so a
    huge ratio on a bad token cannot dominate the batch (dual-clip). The loss is returned
    unmasked; `mask` only selects the tokens counted in the statistics.
    """
    log_ratio = torch.clamp(logprobs - old_logprobs, -logratio_clamp, logratio_clamp)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped)
    negative = advantages < 0
    dual = torch.zeros_like(negative)
    if clip_ratio_c is not None:
        loss = torch.where(negative, torch.minimum(loss, -advantages * clip_ratio_c), loss)
        dual = negative & (ratio > clip_ratio_c)
    return loss, _clip_stats(ratio.detach(), advantages, mask, eps_low, eps_high, dual)


def _clip_stats(
    ratio: Tensor, advantages: Tensor, mask: Tensor, eps_low: float, eps_high: float, dual: Tensor
) -> ClipStats:
    m = mask.bool()
    high = (advantages > 0) & (ratio > 1.0 + eps_high) & m
    low = (advantages < 0) & (ratio < 1.0 - eps_low) & m
    return ClipStats(
        clipped_high=high.sum().float(),
        clipped_low=low.sum().float(),
        dual_clipped=(dual & m).sum().float(),
        tokens=m.sum().float(),
    )


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor, logratio_clamp: float = 20.0) -> Tensor:
    """Per-token k3 estimator of KL(π_θ ‖ π_ref): `exp(ref − logp) − (ref − logp) − 1` ≥ 0."""
    log_ratio = torch.clamp(ref_logprobs - logprobs, -logratio_clamp, logratio_clamp)
    return torch.exp(log_ratio) - log_ratio - 1.0


def overlong_filter_mask(response_mask: Tensor, truncated: Tensor) -> Tensor:
    """Overlong filtering: the response mask `[B, T]` with rows of truncated responses zeroed.

    `truncated` is `[B]` bool. Filtered rows drop out of the loss and of the token count.
    """
    return response_mask.bool() & ~truncated.bool().unsqueeze(-1)


def agg_loss(
    loss_mat: Tensor,
    mask: Tensor,
    mode: LossAggMode,
    global_token_count: Count | None = None,
    global_seq_count: Count | None = None,
    norm_len: Count | None = None,
) -> Tensor:
    """Reduce a per-token loss `[B, T]` to a scalar.

    - "token_mean" (DAPO): Σ masked loss / `global_token_count`. Every token weighs the same
      whatever the length of its response.
    - "seq_mean_token_mean" (GRPO): Σ_i (mean over the tokens of sequence i) /
      `global_seq_count`. Every sequence weighs the same.
    - "seq_mean_token_sum_norm" (Dr.GRPO): Σ masked loss / (`global_seq_count` · `norm_len`),
      with `norm_len` a constant such as the maximum response length (required).

    Counts default to this batch's own (tokens in `mask`; sequences with at least one such
    token). For gradient accumulation or data parallelism pass the counts of the whole
    mini-batch: then the sum of the micro-batch losses is exactly the full-batch loss.
    """
    m = mask.bool()
    masked = torch.where(m, loss_mat, torch.zeros_like(loss_mat))
    tokens_per_seq = m.sum(dim=-1)
    seqs = global_seq_count if global_seq_count is not None else (tokens_per_seq > 0).sum()
    if mode == "token_mean":
        tokens = global_token_count if global_token_count is not None else m.sum()
        return masked.sum() / _at_least_one(tokens)
    if mode == "seq_mean_token_mean":
        seq_means = masked.sum(dim=-1) / tokens_per_seq.clamp(min=1)
        return seq_means.sum() / _at_least_one(seqs)
    if mode == "seq_mean_token_sum_norm":
        if norm_len is None:
            raise ValueError("seq_mean_token_sum_norm needs norm_len (e.g. max response length)")
        return masked.sum() / (_at_least_one(seqs) * norm_len)
    raise ValueError(f"unknown loss aggregation mode {mode!r}")


def longest_loss_share(loss_tokens: list[int], mode: LossAggMode, top: float = 0.25) -> float:
    """The share of a batch's loss weight that its longest `top` fraction of responses
    carries (`loss_tokens`: each response's tokens left in the loss). This is what the
    token-level loss changes: under "seq_mean_token_mean" every response weighs the same,
    so the longest quarter carries a quarter; under "token_mean" (and Dr.GRPO's constant
    norm) a response weighs its length, so long responses carry more."""
    kept = sorted((n for n in loss_tokens if n > 0), reverse=True)
    if not kept:
        return 0.0
    k = max(1, round(len(kept) * top))
    weights = [1.0] * len(kept) if mode == "seq_mean_token_mean" else [float(n) for n in kept]
    return sum(weights[:k]) / sum(weights)


def _at_least_one(count: Count) -> Count:
    """A divisor that is never 0: an empty batch then gives loss 0 and zero gradient."""
    if isinstance(count, Tensor):
        return count.clamp(min=1)
    return max(count, 1)


def token_logprobs(
    logits: Tensor, token_ids: Tensor, temperature: float = 1.0
) -> tuple[Tensor, Tensor]:
    """Log-probs of `token_ids` `[...]` under `softmax(logits / temperature)`, and entropy.

    `logits[..., :]` (`[..., V]`) must be the distribution that the token at the same index
    was sampled from (the caller shifts by one). The rollout engine must report its
    log-probs under the same definition (temperature-scaled, before top-p/top-k), or r and
    the TIS weights are biased. Computed in fp32 at least (bf16 logits are upcast; float64
    stays), through logsumexp rather than log_softmax: backward keeps one `[..., V]` copy
    and the entropy `lse − Σ p·z` one temporary. The entropy is a metric and carries no
    gradient (DAPO has no entropy bonus).
    """
    if temperature <= 0:
        raise ValueError("temperature must be > 0 (greedy samples have no log-probs)")
    z = logits if logits.dtype == torch.float64 else logits.float()
    if temperature != 1.0:
        z = z / temperature
    lse = torch.logsumexp(z, dim=-1)
    picked = z.gather(-1, token_ids.long().unsqueeze(-1)).squeeze(-1) - lse
    with torch.no_grad():
        weighted = (z - lse.unsqueeze(-1)).exp_().mul_(z)
        entropy = lse - weighted.sum(dim=-1)
    return picked, entropy


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of `values` where `mask` is set (0 when nothing is): for metrics like entropy."""
    m = mask.bool()
    return torch.where(m, values, torch.zeros_like(values)).sum() / m.sum().clamp(min=1)


def per_token_loss(
    policy: Tensor,
    is_weights: Tensor | None = None,
    kl: Tensor | None = None,
    kl_coef: float = 0.0,
) -> Tensor:
    """The full per-token objective: `policy_loss`'s loss · IS weights + kl_coef · KL, `[B, T]`.

    Pass `is_weights` from `learner.correction` and `kl` from `kl_k3` when those are on;
    DAPO itself uses neither. Aggregate the result with `agg_loss`.
    """
    loss = policy if is_weights is None else policy * is_weights
    if kl is not None and kl_coef != 0.0:
        loss = loss + kl_coef * kl
    return loss
