"""The engine skeleton, with plain objects in place of models."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from rollout.engine import RolloutEngine, SampleOutput, SamplingParams, StreamedSample
from rollout.engine_base import EngineBase, Gate, default_eos, stop_ids


class EchoEngine(EngineBase):
    """Each sample is its prompt, tagged with the seed it was given and the version."""

    tokenizer = None  # the protocol names one; nothing here decodes

    def __init__(self) -> None:
        super().__init__(vocab_size=10)
        self.seeds: list[int] = []

    def _samples(
        self, prompts: list[list[int]], params: SamplingParams, seed: int
    ) -> Iterator[StreamedSample]:
        self.seeds.append(seed)
        self._gate.enter()
        try:
            version = self._version
            for i, prompt in enumerate(prompts):
                for j in range(params.n):
                    yield StreamedSample(i, j, SampleOutput(prompt, [0.0], "length", version))
        finally:
            self._gate.leave()

    def load_weights(self, named_tensors, version: int) -> None:
        with self._swap(version):
            if not list(named_tensors):
                raise ValueError("empty update")


def test_skeleton_checks_prompts_seeds_and_collects() -> None:
    engine = EchoEngine()
    assert isinstance(engine, RolloutEngine)
    with pytest.raises(ValueError, match="at least one token"):
        engine.stream([[1], []], SamplingParams())
    with pytest.raises(ValueError, match=r"token id 10 is outside the vocabulary \[0, 10\)"):
        engine.stream([[1, 10]], SamplingParams())
    assert engine.seeds == []  # refused before the engine's own sampling runs
    out = engine.generate([[1, 2], [3]], SamplingParams(n=2, seed=42))
    assert [[s.token_ids.tolist() for s in row] for row in out] == [[[1, 2], [1, 2]], [[3], [3]]]
    engine.generate([[1]], SamplingParams())
    assert engine.seeds[0] == 42 and 0 <= engine.seeds[1] < 2**31


def test_failed_swap_keeps_the_version() -> None:
    engine = EchoEngine()
    with pytest.raises(ValueError, match="empty"):
        engine.load_weights([], 3)
    assert engine.version == 0
    engine.load_weights([("w", None)], 3)
    assert engine.version == 3
    assert engine.generate([[1]], SamplingParams())[0][0].policy_version == 3


def test_swap_waits_for_work_inside_and_lets_held_work_go_first() -> None:
    gate, events = Gate(), []

    def swap(name: str) -> None:
        with gate.swapping():
            events.append(name)
            time.sleep(0.1)

    def work() -> None:
        gate.enter()
        events.append("work")
        time.sleep(0.05)
        gate.leave()

    gate.enter()
    first = threading.Thread(target=swap, args=("swap 1",))
    first.start()
    time.sleep(0.1)
    assert events == []  # the swap waits for the work inside
    gate.leave()
    time.sleep(0.03)  # swap 1 is under way: the next swap, then new work, queue behind it
    threads = [threading.Thread(target=swap, args=("swap 2",)), threading.Thread(target=work)]
    for thread in threads:
        thread.start()
        time.sleep(0.02)
    for thread in [first, *threads]:
        thread.join(5)
    assert events == ["swap 1", "work", "swap 2"]


def test_stop_and_eos_rules() -> None:
    class Tok:
        eos_token_id = 7

    assert default_eos(None, Tok()) == [7]
    assert default_eos([1, 2], Tok()) == [1, 2]
    assert default_eos(3, Tok()) == [3]
    assert stop_ids(SamplingParams(stop_token_ids=(9, 4)), [7]) == [4, 7, 9]
    assert stop_ids(SamplingParams(stop_token_ids=(9,), ignore_eos=True), [7]) == [9]


def test_stop_token_ids_become_plain_ints() -> None:
    """Ids read off a response's token array are numpy ints; engines (vLLM) want ints."""
    params = SamplingParams(stop_token_ids=tuple(np.array([3, 5], dtype=np.int64)))
    assert params.stop_token_ids == (3, 5)
    assert all(type(t) is int for t in params.stop_token_ids)
