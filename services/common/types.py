"""Internal record types shared by every process (torch-free).

The logic (filters, admission, the loss, batching) handles these dataclasses; servicers
and clients translate to and from protobuf with the adapters (`services/common/adapters.py`
and each role's `adapter.py`) and touch raw messages only for request fields that need
no record type (limits, versions, weight buckets).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

FinishReason = Literal["stop", "length", "abort"]
IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float32]


def token_array(values: Iterable[int] | npt.ArrayLike) -> IntArray:
    """Token ids or versions as one int64 array (no copy when already one): responses of
    16k tokens stay one object from the engine to the learner's tensors."""
    if isinstance(values, np.ndarray) and values.dtype == np.int64 and values.ndim == 1:
        return values  # the common case, per sample in every service: no numpy call
    return np.asarray(_materialised(values), dtype=np.int64).reshape(-1)


def logprob_array(values: Iterable[float] | npt.ArrayLike) -> FloatArray:
    """Per-token log-probs as one float32 array (the engines' and the wire's precision)."""
    if isinstance(values, np.ndarray) and values.dtype == np.float32 and values.ndim == 1:
        return values
    return np.asarray(_materialised(values), dtype=np.float32).reshape(-1)


def arrays_equal(a: Any, b: Any) -> bool:
    """Dataclass equality for records holding arrays (the generated `==` can't compare
    them): same type and every field equal, arrays element-wise."""
    if type(a) is not type(b):
        return False
    for f in fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)  # probe-ok: dataclass fields
        same = np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y
        if not same:
            return False
    return True


_SEQUENCES = (np.ndarray, list, tuple)  # a tuple: isinstance with a `|` union is slower


def _materialised(values: Any) -> Any:
    """Arrays, lists and tuples as they are; any other iterable (a generator) as a list."""
    return values if isinstance(values, _SEQUENCES) else list(values)


def versions_per_token(versions: IntArray | None, length: int, policy_version: int) -> IntArray:
    """Each of `length` tokens' policy version: `versions` when given, else `policy_version`
    for all (a response sampled by one version carries no per-token list)."""
    if versions is not None and len(versions):
        return versions
    return np.full(length, policy_version, dtype=np.int64)


class TokenArrays:
    """Base of the records that hold a response's per-token arrays (`token_ids`,
    `logprobs`, `token_versions`): lists given to the constructor (engines, tests) become
    arrays once, and `==` compares the arrays element-wise."""

    token_ids: IntArray
    logprobs: FloatArray
    token_versions: IntArray

    def __post_init__(self) -> None:
        self.token_ids = token_array(self.token_ids)
        self.logprobs = logprob_array(self.logprobs)
        self.token_versions = token_array(self.token_versions)

    def __eq__(self, other: object) -> bool:
        return arrays_equal(self, other)

    __hash__ = None  # type: ignore[assignment]  # mutable, as a dataclass with eq


@dataclass(eq=False)
class Sample(TokenArrays):
    """One sampled response, with its verdict once scored.

    `policy_version` is the oldest version among its tokens; `token_versions` names the
    version of each token when they differ (a partial rollout continued across a weight
    update), and is empty when every token has `policy_version`.
    """

    token_ids: IntArray
    logprobs: FloatArray
    text: str
    finish_reason: FinishReason
    policy_version: int
    reward: float = 0.0
    correct: bool = False
    pred: str = ""
    truncated: bool = False
    overlong_penalty: float = 0.0
    error: str = ""
    token_versions: IntArray = field(default_factory=lambda: token_array(()))

    def versions(self) -> IntArray:
        """The policy version of every token (the behaviour policy of its log-prob)."""
        return versions_per_token(self.token_versions, len(self.token_ids), self.policy_version)


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
