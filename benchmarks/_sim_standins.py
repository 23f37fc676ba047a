"""Stand-ins for the GPU-bound parts of the pipeline that cost time, not CPU.

`SimEngine` is a rollout engine on the real `EngineBase` that sleeps per decode step,
with vLLM's declared concurrency and continuous batching and DAPO-shaped long-tailed
lengths; `SimTrainer` is the learner's `Trainer` with the model left out, sleeping per
trained token and per published byte. Everything around them is the real code.
Details: benchmarks/README.md, "`pipeline_sim`".
"""

from __future__ import annotations

import math
import random
import re
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from learner.config import LearnerSettings
from learner.deepspeed_policy import copy_overlaps
from learner.dist import Single
from learner.step import StepMetrics
from learner.trainer import Trainer
from rollout.config import VllmEngineConfig
from rollout.engine import SampleOutput, SamplingParams, StreamedSample
from rollout.engine_base import EngineBase
from rollout.vllm_engine import VllmEngine
from services.common.types import Group

TAIL = 0.06  # share of responses that run to L_max (truncated), as in DAPO's early steps
SPREAD = 0.8  # log-normal sigma of the rest


@dataclass(frozen=True)
class SimCosts:
    """What the simulated cluster's devices cost, in seconds."""

    token_s: float = 0.001  # one decode step of the running batch
    tick_tokens: int = 8  # decode steps between two looks at the clock (and at a swap)
    slots: int = 64  # rows decoded together
    train_token_s: float = 16e-6  # one trained token (prompt + response)
    publish_byte_s: float = 5e-9  # gathering one weight byte for publication
    weight_bytes: int = 4 << 20

    @property
    def tick_s(self) -> float:
        return self.token_s * self.tick_tokens


def draw_length(rng: random.Random, l_max: int) -> int:
    """Most responses short (log-normal around L_max / 8), a tail of TAIL at L_max."""
    if rng.random() < TAIL:
        return l_max
    return max(1, min(l_max, int(rng.lognormvariate(math.log(l_max / 8), SPREAD))))


def mean_length(l_max: int, draws: int = 20000) -> float:
    rng = random.Random(0)
    return sum(draw_length(rng, l_max) for _ in range(draws)) / draws


@dataclass
class _Row:
    index: int
    sample: int
    body: list[int]  # the whole response it will produce
    versions: list[int] = field(default_factory=list)


class SimEngine(EngineBase):
    """Sleeps per decode step of its slots; see the module docstring."""

    def __init__(
        self,
        tokenizer: Any,
        costs: SimCosts,
        partial_rollouts: bool,
        engine: VllmEngineConfig,
        seed: int = 0,
    ):
        super().__init__(len(tokenizer), 0, partial_rollouts)
        self.tokenizer, self.costs = tokenizer, costs
        self._calls = VllmEngine.concurrency(engine)
        self._slots = threading.Semaphore(costs.slots)
        self._rng = random.Random(seed)
        self._rng_lock = threading.Lock()
        self._filler = tokenizer.encode("+", add_special_tokens=False)[-1]  # no digit
        self._stats_lock = threading.Lock()
        self.row_seconds = 0.0  # slot-seconds spent decoding
        self.tokens = 0

    @property
    def max_concurrent_calls(self) -> int:
        return self._calls

    def _body(self, prompt: list[int], max_tokens: int) -> list[int]:
        """Response tokens: the answer (right with the prompt's own odds), then filler."""
        digits = [int(d) for d in re.findall(r"\d", self.tokenizer.decode(prompt))] or [0]
        p_right = random.Random(str(prompt)).uniform(0.15, 0.85)
        with self._rng_lock:
            right = self._rng.random() < p_right
            length = draw_length(self._rng, max_tokens)
        answer = max(digits) if right else (max(digits) + 1) % 10
        head = self.tokenizer.encode(str(answer), add_special_tokens=False)
        return (head + [self._filler] * length)[: max(length, 1)]

    def _samples(
        self, prompts: list[list[int]], params: SamplingParams, seed: int
    ) -> Iterator[StreamedSample]:
        rows = deque(
            _Row(i, j, self._body(p, params.max_tokens))
            for i, p in enumerate(prompts)
            for j in range(params.n)
        )
        self._gate.enter()
        try:
            yield from self._decode(rows, params.max_tokens)
        finally:
            self._gate.leave()

    def _decode(self, pending: deque[_Row], max_tokens: int) -> Iterator[StreamedSample]:
        running: list[_Row] = []
        while pending or running:
            if self._preempt_wanted():
                self._yield_to_swap()
            self._take_slots(pending, running)
            if not running:
                continue
            time.sleep(self.costs.tick_s)
            done = self._advance(running)
            for row in done:
                running.remove(row)
                self._slots.release()
                yield self._output(row, max_tokens)

    def _take_slots(self, pending: deque[_Row], running: list[_Row]) -> None:
        """Free slots go to waiting rows; with none running, wait one tick for a slot."""
        while pending:
            got = (
                self._slots.acquire(blocking=False)
                if running
                else self._slots.acquire(timeout=self.costs.tick_s)
            )
            if not got:
                return
            running.append(pending.popleft())

    def _advance(self, running: list[_Row]) -> list[_Row]:
        """One tick of decoding under the current version; the rows that finished."""
        step = self.costs.tick_tokens
        for row in running:
            row.versions += [self._version] * min(step, len(row.body) - len(row.versions))
        with self._stats_lock:
            self.row_seconds += len(running) * self.costs.tick_s
            self.tokens += len(running) * step
        return [row for row in running if len(row.versions) == len(row.body)]

    def _output(self, row: _Row, max_tokens: int) -> StreamedSample:
        out = SampleOutput(
            token_ids=row.body,
            logprobs=[-0.5] * len(row.body),
            finish_reason="length" if len(row.body) >= max_tokens else "stop",
            policy_version=min(row.versions),
            token_versions=row.versions,
        )
        return StreamedSample(row.index, row.sample, out)

    def load_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, owned: bool = False
    ) -> None:
        """The bytes were pulled for real; applying them is the swap itself."""
        for _ in named_tensors:
            pass
        with self._swap(version):
            pass


class SimPolicy:
    """The publication half of the learner's `Policy`: one real weight tensor whose
    gathering sleeps per byte (the step itself is `SimTrainer.train`)."""

    def __init__(self, costs: SimCosts, zero_stage: int) -> None:
        self.costs = costs
        self.weight_copy_overlaps = copy_overlaps(zero_stage)  # as the DeepSpeed policy's
        self.weight = torch.zeros(costs.weight_bytes // 4, dtype=torch.float32)

    def weight_count(self) -> int:
        return 1

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        time.sleep(self.costs.publish_byte_s * self.costs.weight_bytes)
        self.weight[0] += 1  # each version differs
        yield "sim.weight", self.weight

    def advance_schedule(self) -> None:
        pass


class SimTrainer(Trainer):
    """The learner's Trainer without a model: a step sleeps per trained token."""

    def __init__(self, config: LearnerSettings, costs: SimCosts) -> None:  # no super(): no model
        self.config, self.model_path, self.pad_id = config, str(config.model_path), 0
        self.policy = SimPolicy(costs, config.learner.deepspeed.zero_stage)  # type: ignore[assignment]
        self.dp, self.reference, self.costs = Single(), None, costs
        self.busy: list[tuple[float, float]] = []  # (start, end) of each step

    def train(self, groups: list[Group], seed: int, version: int = 0) -> StepMetrics:
        started = time.time()  # wall clock, as the Redis stream ids it is compared with
        samples = [(g, s) for g in groups for s in g.samples]
        tokens = sum(len(g.prompt_token_ids) + len(s.token_ids) for g, s in samples)
        time.sleep(tokens * self.costs.train_token_s)
        ended = time.time()
        self.busy.append((started, ended))
        response = sum(len(s.token_ids) for _, s in samples)
        return StepMetrics(
            tokens=response,
            seconds=ended - started,
            tokens_per_s=tokens / max(ended - started, 1e-9),
            response_length=response / max(len(samples), 1),
            accuracy=sum(s.correct for _, s in samples) / max(len(samples), 1),
        )
