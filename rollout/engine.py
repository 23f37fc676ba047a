"""The rollout engine interface: what the rollout service needs from an inference engine.

Kept narrow on purpose so that the torch engine and the vLLM engine both implement all of
it; the gRPC service, limits and weight transport live elsewhere. Prompts and responses
are token ids: tokenisation belongs to the caller, so the learner, the engine and the
reward see exactly the same tokens.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from services.common.types import (
    FinishReason,
    FloatArray,
    IntArray,
    TokenArrays,
    token_array,
)

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase


MIN_TEMPERATURE = 1e-5  # below it logits / T overflow float32 and log-probs come back NaN


@dataclass(frozen=True)
class SamplingParams:
    """How to sample the n responses of one prompt.

    `temperature == 0` means greedy decoding. The engine's EOS token always stops a
    sample (unless `ignore_eos`); `stop_token_ids` add more stop tokens. The stop token
    is part of the returned response (the learner trains on it).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        # plain ints: ids read off token arrays are numpy ints, which vLLM refuses
        object.__setattr__(self, "stop_token_ids", tuple(map(int, self.stop_token_ids)))
        checks = [
            (self.n >= 1, "n must be >= 1", self.n),
            (
                self.temperature == 0 or MIN_TEMPERATURE <= self.temperature < math.inf,
                f"temperature must be 0 (greedy) or finite and >= {MIN_TEMPERATURE}",
                self.temperature,
            ),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]", self.top_p),
            (self.top_k == -1 or self.top_k >= 1, "top_k must be -1 (off) or >= 1", self.top_k),
            (self.max_tokens >= 1, "max_tokens must be >= 1", self.max_tokens),
        ]
        for ok, message, value in checks:
            if not ok:  # the one value, never the whole request (it may be megabytes)
                raise ValueError(f"{message}, got {value!r}")


@dataclass(eq=False)
class SampleOutput(TokenArrays):
    """One generated response: token ids with the log-prob of each under the sampler.

    `policy_version` is the oldest version among its tokens; `token_versions` (empty, or
    one per token) says which version sampled each token, for partial rollouts.
    """

    token_ids: IntArray
    logprobs: FloatArray
    finish_reason: FinishReason
    policy_version: int
    token_versions: IntArray = field(default_factory=lambda: token_array(()))


@dataclass(frozen=True)
class StreamedSample:
    """A sample as it completes: which prompt (`request_index`) and which of its n."""

    request_index: int
    sample_index: int
    output: SampleOutput


@runtime_checkable
class RolloutEngine(Protocol):
    """An inference engine that samples responses and takes new weights in place.

    Implementations are thread-safe. Without partial rollouts weights are never swapped
    in the middle of a batch, so every sample is produced by exactly the version it is
    tagged with; with them a swap happens between two tokens and every token is tagged
    with the version that produced it (`SampleOutput.token_versions`).
    """

    @property
    def version(self) -> int:
        """Policy version of the weights currently in use."""
        ...

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The model's tokenizer: chat templates and decoding happen outside the engine."""
        ...

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[list[SampleOutput]]:
        """All `params.n` samples of every prompt: `result[prompt][sample]`."""
        ...

    def stream(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> Iterator[StreamedSample]:
        """The same samples, each yielded as soon as it is complete (any order)."""
        ...

    def load_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, owned: bool = False
    ) -> None:
        """Replace (some of) the weights and set the version.

        Every tensor is checked (known name, same shape, same dtype) before any is
        applied; on a mismatch a ValueError names it and the old weights stay in use.
        `owned`: the caller gives the tensors up (nothing will write to them again), so an
        engine may serve them in place instead of copying them.
        """
        ...

    def pause(self) -> None:
        """Finish the batch in flight, then start no new work until `resume()`."""
        ...

    def resume(self) -> None:
        """Undo `pause()`."""
        ...

    @property
    def max_concurrent_calls(self) -> int:
        """Engine calls a server may run at once. 1: one call at a time, so the batcher
        merges concurrent groups into it (torch). More: the engine schedules concurrent
        calls itself (continuous batching), so each group is handed over as it arrives."""
        ...

    def kv_cache_usage(self) -> float | None:
        """Fraction (0..1) of the KV-cache pool in use; None for an engine without one."""
        ...

    def model_cpu_seconds(self) -> float | None:
        """CPU seconds the model's work has taken in this process so far (what `dapo up`
        subtracts from the server's CPU to report the rest as service overhead); None
        where the model runs elsewhere (vLLM's engine core process, a GPU)."""
        ...

    def close(self) -> None:
        """Release the engine's processes and memory; it takes no calls afterwards."""
        ...


def collect(
    samples: Iterable[StreamedSample], num_prompts: int, n: int
) -> list[list[SampleOutput]]:
    """Gather a stream into `result[prompt][sample]` (what `generate` returns)."""
    result: list[list[SampleOutput | None]] = [[None] * n for _ in range(num_prompts)]
    for item in samples:
        result[item.request_index][item.sample_index] = item.output
    return [[s for s in row if s is not None] for row in result]


def out_of_vocab(prompt: Iterable[int], vocab_size: int) -> int | None:
    """The first token id outside [0, vocab_size), else None."""
    return next((t for t in prompt if not 0 <= t < vocab_size), None)
