"""Partial rollouts on vLLM: what a response keeps across a weight swap, and the rule that
keeps request submissions and swaps apart. No vLLM or torch here (asyncio only), so it
imports, and is tested, anywhere.

`Stitched` joins a response's segments (vLLM requests cut by swaps) and tags each token
with its segment's version; `Admission` holds new additions during a swap so that tag is
exact. How: docs/vllm.md, "Inside the engine" (partial rollouts).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Collection, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from rollout.engine import SampleOutput
from services.common.types import FinishReason, logprob_array, token_array


def sample_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """The vLLM seed of one sample: a function of the request seed and its indices only."""
    return random.Random(f"{seed}/{prompt_index}/{sample_index}").getrandbits(31)


def segment_seed(seed: int, prompt_index: int, sample_index: int, done: int) -> int:
    """The seed of a segment that starts after `done` tokens: the sample's own seed for
    the first, a fresh one per seam after it (reusing it would replay the first segment's
    random draws)."""
    if done == 0:
        return sample_seed(seed, prompt_index, sample_index)
    return random.Random(f"{seed}/{prompt_index}/{sample_index}/{done}").getrandbits(31)


def finish_after_abort(
    token_ids: Sequence[int], max_tokens: int, stops: Collection[int]
) -> FinishReason | None:
    """How a response cut by a swap already ended, if it did: vLLM may report an abort
    for a request whose last token was a stop token or used up the budget, in the same
    step; continuing it would overrun."""
    if token_ids and token_ids[-1] in stops:
        return "stop"
    if len(token_ids) >= max_tokens:
        return "length"
    return None


@dataclass
class Stitched:
    """The tokens of one response so far, over all its segments."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    def extend(self, token_ids: Sequence[int], logprobs: Sequence[float], version: int) -> None:
        """Append one segment's tokens, all sampled by `version`."""
        if len(token_ids) != len(logprobs):
            raise RuntimeError(f"{len(logprobs)} log-probs for {len(token_ids)} tokens")
        self.token_ids.extend(token_ids)
        self.logprobs.extend(logprobs)
        self.versions.extend([version] * len(token_ids))

    def output(self, finish_reason: FinishReason, version: int) -> SampleOutput:
        """The finished response; `version` tags it when it has no token."""
        return SampleOutput(
            token_ids=token_array(self.token_ids),
            logprobs=logprob_array(self.logprobs),
            finish_reason=finish_reason,
            policy_version=min(self.versions, default=version),
            token_versions=token_array(self.versions),
        )


class Admission:
    """Many request additions at once, or one swap; lives on the engine's event loop."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._held = False
        self._adding = 0
        self.swaps = 0  # swaps begun: a segment aborted after its addition saw one

    @asynccontextmanager
    async def adding(self) -> AsyncIterator[None]:
        """Wait for any swap to finish, then add a request inside the block."""
        async with self._cond:
            await self._cond.wait_for(lambda: not self._held)
            self._adding += 1
        try:
            yield
        finally:
            async with self._cond:
                self._adding -= 1
                self._cond.notify_all()

    @asynccontextmanager
    async def holding(self) -> AsyncIterator[None]:
        """Hold new additions and wait for those under way; the swap runs inside."""
        async with self._cond:
            await self._cond.wait_for(lambda: not self._held)
            self._held = True
            self.swaps += 1
            await self._cond.wait_for(lambda: self._adding == 0)
        try:
            yield
        finally:
            async with self._cond:
                self._held = False
                self._cond.notify_all()
