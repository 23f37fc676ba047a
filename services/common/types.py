"""Internal record types shared by every process (torch-free).

The logic (filters, admission, the loss, batching) handles these dataclasses; servicers
and clients translate to and from protobuf with the adapters (`services/common/adapters.py`
and each role's `adapter.py`) and touch raw messages only for request fields that need
no record type (limits, versions, weight buckets).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort"]


@dataclass
class Sample:
    """One sampled response, with its verdict once scored.

    `policy_version` is the oldest version among its tokens; `token_versions` names the
    version of each token when they differ (a partial rollout continued across a weight
    update), and is empty when every token has `policy_version`.
    """

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: FinishReason
    policy_version: int
    reward: float = 0.0
    correct: bool = False
    pred: str = ""
    truncated: bool = False
    overlong_penalty: float = 0.0
    error: str = ""
    token_versions: list[int] = field(default_factory=list)

    def versions(self) -> list[int]:
        """The policy version of every token (the behaviour policy of its log-prob)."""
        return list(self.token_versions) or [self.policy_version] * len(self.token_ids)


@dataclass
class Group:
    """The G samples of one prompt: the unit of dynamic sampling and of training."""

    group_id: str
    prompt_id: str
    prompt: str
    prompt_token_ids: list[int]
    ground_truth: str
    samples: list[Sample] = field(default_factory=list)
    run_id: str = ""
    epoch: int = 0
    admitted_version: int = 0
    admitted_at: float = 0.0
    scored_at: float = 0.0
    data_source: str = ""

    @property
    def accuracy(self) -> float:
        """Fraction of correct samples (0.0 for an empty group)."""
        return sum(s.correct for s in self.samples) / len(self.samples) if self.samples else 0.0

    @property
    def min_policy_version(self) -> int:
        """Oldest policy version among the samples: what staleness is measured from."""
        return min((s.policy_version for s in self.samples), default=self.admitted_version)
