"""What every rollout engine does the same way, written once.

`EngineBase` holds the policy version and turns `stream` / `generate` / `pause` /
`resume` into one hook, `_samples`; the functions below are the rules both engines must
agree on (refused prompts, stop tokens, weight checks). `Gate` lets a weight swap in only
when no generation is inside, so every token is produced by the version it is tagged
with. How partial rollouts continue a response across a swap: docs/architecture.md,
"The rollout server".
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from rollout.engine import SampleOutput, SamplingParams, StreamedSample, collect, out_of_vocab

if TYPE_CHECKING:
    import torch


class Gate:
    """Admits generation work; pause and weight swaps hold new work back."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._paused = self._swapping = False
        self._active = self._waiting = 0

    def enter(self) -> None:
        """Wait until neither paused nor swapping, then count one unit of work in."""
        with self._cond:
            self._waiting += 1
            self._cond.wait_for(lambda: not (self._paused or self._swapping))
            self._waiting -= 1
            self._active += 1

    def leave(self) -> None:
        with self._cond:
            self._active -= 1
            self._cond.notify_all()

    def set_paused(self, paused: bool) -> None:
        """Hold (or release) new work; work already inside carries on."""
        with self._cond:
            self._paused = paused
            self._cond.notify_all()

    def swap_waiting(self) -> bool:
        """A swap is waiting for the work inside to leave."""
        with self._cond:
            return self._swapping

    def yield_to_swap(self) -> None:
        """Step out for a waiting swap and come back in once it is done."""
        self.leave()
        self.enter()

    def wait_idle(self) -> None:
        """Return once no work is inside."""
        with self._cond:
            self._cond.wait_for(lambda: self._active == 0)

    @contextmanager
    def swapping(self) -> Iterator[None]:
        """Hold new work and wait until none is inside (allowed while paused).

        Work held back by the previous swap goes in first: back-to-back swaps would
        otherwise starve generation.
        """
        with self._cond:
            self._cond.wait_for(lambda: not self._swapping and (self._paused or not self._waiting))
            self._swapping = True
            self._cond.wait_for(lambda: self._active == 0)
        try:
            yield
        finally:
            with self._cond:
                self._swapping = False
                self._cond.notify_all()


class EngineBase:
    """The `RolloutEngine` skeleton: an engine adds `_samples` and `load_weights`.

    `_samples` gets prompts already checked against `vocab_size` and a concrete seed
    (drawn here when the request has none), so engines never repeat either.
    """

    def __init__(self, vocab_size: int, version: int = 0, partial_rollouts: bool = False) -> None:
        self.vocab_size = vocab_size
        self._version = version
        self._gate = Gate()
        self.partial_rollouts = partial_rollouts

    @property
    def version(self) -> int:
        """Policy version of the weights in use."""
        return self._version

    @property
    def max_concurrent_calls(self) -> int:
        """One call at a time: the batcher merges concurrent groups into it."""
        return 1

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[list[SampleOutput]]:
        """All n samples of every prompt: `result[prompt][sample]`."""
        return collect(self.stream(prompts, params), len(prompts), params.n)

    def stream(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> Iterator[StreamedSample]:
        """Samples as they complete; bad prompts raise ValueError here, not on first use."""
        check_prompts(prompts, self.vocab_size)
        seed = params.seed if params.seed is not None else random.getrandbits(31)
        return self._samples([list(p) for p in prompts], params, seed)

    def _samples(
        self, prompts: list[list[int]], params: SamplingParams, seed: int
    ) -> Iterator[StreamedSample]:
        """The engine's own sampling; it runs its work inside `self._gate`."""
        raise NotImplementedError

    def _preempt_wanted(self) -> bool:
        """Partial rollouts are on and a weight swap waits: stop at this token boundary."""
        return self.partial_rollouts and self._gate.swap_waiting()

    def _yield_to_swap(self) -> None:
        """Let the waiting swap in; the caller then continues under the new weights."""
        self._gate.yield_to_swap()

    def kv_cache_usage(self) -> float | None:
        """No KV-cache pool: each call allocates its own cache."""
        return None

    def model_cpu_seconds(self) -> float | None:
        """Not measured (an engine that measures it says so)."""
        return None

    def close(self) -> None:
        """Nothing to release beyond what garbage collection frees."""

    def pause(self) -> None:
        """Let the work in flight finish; hold new work until `resume()`."""
        self._gate.set_paused(True)

    def resume(self) -> None:
        """Let generation continue."""
        self._gate.set_paused(False)

    @contextmanager
    def _swap(self, version: int) -> Iterator[None]:
        """Hold generation while the body replaces weights; the version moves only if
        the body returns (a failed swap keeps the old version)."""
        with self._gate.swapping():
            yield
            self._version = version


def check_prompts(prompts: Sequence[Sequence[int]], vocab_size: int) -> None:
    """Reject what would crash a model (an out-of-range id is fatal on CUDA)."""
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    for prompt in prompts:
        bad = out_of_vocab(prompt, vocab_size)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")


def default_eos(generation_eos: int | Sequence[int] | None, tokenizer: Any) -> list[int]:
    """EOS ids from the generation config, else the tokenizer: the same rule in both
    engines, so the same request stops at the same token."""
    eos = generation_eos if generation_eos is not None else tokenizer.eos_token_id
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)


def stop_ids(params: SamplingParams, eos_token_ids: Sequence[int]) -> list[int]:
    """EOS (unless ignored) plus the request's own stop tokens, sorted."""
    eos = set() if params.ignore_eos else set(eos_token_ids)
    return sorted(set(params.stop_token_ids) | eos)


def check_weights(
    updates: Sequence[tuple[str, torch.Tensor]],
    expected: Mapping[str, tuple[torch.Size, torch.dtype]],
) -> None:
    """Raise ValueError naming the first unknown, misshapen or mistyped weight."""
    for name, tensor in updates:
        if name not in expected:
            raise ValueError(f"unknown weight {name!r}; weights left unchanged")
        shape, dtype = expected[name]
        if tuple(tensor.shape) != tuple(shape):
            raise ValueError(
                f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(shape)}; "
                "weights left unchanged"
            )
        if tensor.dtype != dtype:
            raise ValueError(
                f"weight {name!r} has dtype {tensor.dtype}, expected {dtype}; "
                "weights left unchanged"
            )


def uncovered(names: set[str], targets: Mapping[str, Any]) -> list[str]:
    """Weights (tensors) that no incoming name writes to; a tied weight (one tensor under
    two names) is covered by either name."""
    covered = {targets[name].data_ptr() for name in names}
    return [name for name, t in targets.items() if t.data_ptr() not in covered]


def refuse_missing(missing: Sequence[str], engine: str) -> None:
    """Refuse an update that leaves weights out: samples tagged with its version would
    come from a mix of versions."""
    if missing:
        raise ValueError(
            f"weight {missing[0]!r} is missing ({len(missing)} in all): the {engine} engine "
            "takes complete weight sets only; weights left unchanged"
        )
