"""What a training step reports, and the named sums it reports them from.

A step's means (loss, clip fractions, entropy, KL, off-policy weights, engine mismatch,
policy lag) are sums over tokens divided by token counts. Micro-batches and data-parallel
ranks add the sums (`StepSums`), never the means, so the result is exact however the
batch was cut. The sums cross ranks as one float64 vector: `StepSums.to_tensor` and
`StepSums.from_tensor` are the only code that knows its order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor

from learner.algorithm import ClipStats
from learner.batch import TrainSequence
from learner.correction import OffPolicySums
from services.common.types import Group


@dataclass
class StepMetrics:
    """What one step reports (metrics, the progress bar, report.json)."""

    loss: float = 0.0
    clip_frac_high: float = 0.0  # Â > 0 tokens above 1 + ε_high (clip-higher's bound)
    clip_frac_low: float = 0.0  # Â < 0 tokens below 1 − ε_low
    clip_frac_dual: float = 0.0  # Â < 0 tokens above the dual-clip bound c
    entropy: float = 0.0
    grad_norm: float = 0.0
    lr: float = 0.0
    tokens: int = 0
    tokens_per_s: float = 0.0
    response_length: float = 0.0
    response_length_max: int = 0
    truncated_frac: float = 0.0  # responses that hit L_max (overlong filtering masks these)
    longest_loss_share: float = 0.0  # loss weight of the longest quarter (token-level loss)
    informative_frac: float = 0.0  # groups whose rewards differ (dynamic sampling keeps these)
    reward_mean: float = 0.0
    accuracy: float = 0.0
    engine_mismatch: float = 0.0  # mean |log π_behav − log π_old| over same-version tokens
    mismatch_tokens: int = 0  # tokens the mismatch is over (sampled by the current version)
    policy_lag: float = 0.0  # mean versions between a token's sampler and the learner
    policy_lag_max: int = 0
    is_weight_mean: float = 1.0  # mean off-policy weight over loss tokens (1: no correction)
    is_masked_frac: float = 0.0  # loss tokens whose weight is 0 (masked by the correction)
    kl: float = 0.0
    updates: int = 0
    skipped_updates: int = 0  # mini-batches with no loss token left (all overlong-filtered)
    old_logprobs_reused: int = 0  # 1: the engine's log-probs were π_old (no recompute)
    seconds: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass(frozen=True)
class StepSums:
    """Sums over a step's loss tokens (and, for `off_policy`, its response tokens).

    `clip.tokens` counts the loss tokens: the divisor of every loss-token mean.
    """

    clip: ClipStats = field(default_factory=ClipStats.zero)
    loss: float = 0.0  # Σ over micro-batches of its loss × its mini-batch's loss tokens
    entropy: float = 0.0  # Σ token entropy
    kl: float = 0.0  # Σ token k3 KL to the reference (0 without a KL term)
    is_weight: float = 0.0  # Σ token off-policy weight (1 per token without a correction)
    is_masked: float = 0.0  # tokens whose off-policy weight is 0
    off_policy: OffPolicySums = field(default_factory=OffPolicySums)

    def __add__(self, other: StepSums) -> StepSums:
        a, b = self.off_policy, other.off_policy
        return StepSums(
            clip=self.clip + other.clip,
            loss=self.loss + other.loss,
            entropy=self.entropy + other.entropy,
            kl=self.kl + other.kl,
            is_weight=self.is_weight + other.is_weight,
            is_masked=self.is_masked + other.is_masked,
            off_policy=OffPolicySums(
                mismatch=a.mismatch + b.mismatch,
                mismatch_tokens=a.mismatch_tokens + b.mismatch_tokens,
                lag=a.lag + b.lag,
                tokens=a.tokens + b.tokens,
            ),
        )

    def to_tensor(self) -> Tensor:
        """Every sum in one float64 vector, for one all-reduce (`from_tensor` reads it)."""
        c, o = self.clip, self.off_policy
        values = [
            *(float(t) for t in (c.clipped_high, c.clipped_low, c.dual_clipped, c.tokens)),
            *(self.loss, self.entropy, self.kl, self.is_weight, self.is_masked),
            *(o.mismatch, o.mismatch_tokens, o.lag, o.tokens),
        ]
        return torch.tensor(values, dtype=torch.float64)

    @classmethod
    def from_tensor(cls, flat: Tensor) -> StepSums:
        """The sums `to_tensor` flattened (after the all-reduce)."""
        high, low, dual, tokens, *rest = flat.to(torch.float64).cpu().unbind()
        loss, entropy, kl, is_weight, is_masked, mismatch, mismatch_tokens, lag, lag_tokens = (
            float(v) for v in rest
        )
        return cls(
            clip=ClipStats(clipped_high=high, clipped_low=low, dual_clipped=dual, tokens=tokens),
            loss=loss,
            entropy=entropy,
            kl=kl,
            is_weight=is_weight,
            is_masked=is_masked,
            off_policy=OffPolicySums(mismatch, mismatch_tokens, lag, lag_tokens),
        )


def report_sums(metrics: StepMetrics, sums: StepSums) -> None:
    """The step's means from its sums (summed over every micro-batch and rank)."""
    tokens = max(float(sums.clip.tokens), 1.0)
    fractions = sums.clip.fractions()
    metrics.loss = sums.loss / tokens
    metrics.clip_frac_high = fractions["clip_frac_high"]
    metrics.clip_frac_low = fractions["clip_frac_low"]
    metrics.clip_frac_dual = fractions["clip_frac_dual"]
    metrics.entropy = sums.entropy / tokens
    metrics.kl = sums.kl / tokens
    metrics.is_weight_mean = sums.is_weight / tokens if float(sums.clip.tokens) else 1.0
    metrics.is_masked_frac = sums.is_masked / tokens
    o = sums.off_policy
    metrics.engine_mismatch = o.mismatch / max(o.mismatch_tokens, 1.0)
    metrics.mismatch_tokens = int(o.mismatch_tokens)
    metrics.policy_lag = o.lag / max(o.tokens, 1.0)


def report_batch(metrics: StepMetrics, seqs: list[TrainSequence], groups: Sequence[Group]) -> None:
    """What the batch itself says: lengths, truncation, rewards, accuracy, informative groups."""
    n = max(len(seqs), 1)
    metrics.tokens = int(sum(len(s.response_ids) for s in seqs))
    metrics.response_length = metrics.tokens / n
    metrics.response_length_max = max((len(s.response_ids) for s in seqs), default=0)
    metrics.truncated_frac = sum(s.truncated for s in seqs) / n
    metrics.reward_mean = sum(s.reward for s in seqs) / n
    samples = [s for g in groups for s in g.samples]
    metrics.accuracy = sum(s.correct for s in samples) / max(len(samples), 1)
    informative = [g for g in groups if 0 < g.accuracy < 1]  # DAPO's rule (0 < acc < 1)
    metrics.informative_frac = len(informative) / max(len(groups), 1)
