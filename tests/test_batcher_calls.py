"""The batcher runs as many engine calls at once as the engine takes (continuous
batching engines take many; the torch engine one), and no more."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from rollout.batcher import Batcher, BatcherClosed
from rollout.engine import SampleOutput, SamplingParams, StreamedSample
from rollout.engine_base import EngineBase


class DeclaredEngine(EngineBase):
    """A test engine that declares `max_calls` concurrent calls."""

    def __init__(self, max_calls: int) -> None:
        super().__init__(vocab_size=16)
        self.max_calls = max_calls

    @property
    def max_concurrent_calls(self) -> int:
        return self.max_calls


class HeldEngine(DeclaredEngine):
    """Each call waits for `release`; `running` / `most` count calls inside at once."""

    def __init__(self, max_calls: int) -> None:
        super().__init__(max_calls)
        self.release = threading.Event()
        self.running = self.most = 0
        self._lock = threading.Lock()

    def _samples(
        self, prompts: list[list[int]], params: SamplingParams, seed: int
    ) -> Iterator[StreamedSample]:
        with self._lock:
            self.running += 1
            self.most = max(self.most, self.running)
        self.release.wait(10)
        with self._lock:
            self.running -= 1
        for i in range(len(prompts)):
            for j in range(params.n):
                yield StreamedSample(i, j, SampleOutput([1], [-0.1], "stop", self.version))


@pytest.mark.parametrize("max_calls", [1, 3])
def test_engine_calls_run_side_by_side_up_to_the_engine_limit(max_calls: int) -> None:
    engine = HeldEngine(max_calls)
    batcher = Batcher(engine, max_sequences=8)
    results: dict[int, int] = {}

    def call(i: int) -> None:  # distinct seeds: never merged, one engine call each
        params = SamplingParams(n=2, seed=i + 1)
        results[i] = len(list(batcher.submit([i + 1], params)))

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 5
    while engine.running < max_calls and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)  # a call beyond the limit would have started by now
    assert engine.running == max_calls
    assert batcher.pending() == 4 - max_calls
    engine.release.set()
    for t in threads:
        t.join(10)
    assert results == {0: 2, 1: 2, 2: 2, 3: 2} and engine.most == max_calls
    batcher.close()


class CountingEngine(DeclaredEngine):
    """Records the prompts of each engine call; calls take `hold_s`."""

    def __init__(self, max_calls: int, hold_s: float) -> None:
        super().__init__(max_calls)
        self.hold_s = hold_s
        self.calls: list[list[list[int]]] = []

    def _samples(
        self, prompts: list[list[int]], params: SamplingParams, seed: int
    ) -> Iterator[StreamedSample]:
        self.calls.append(prompts)
        time.sleep(self.hold_s)
        for i in range(len(prompts)):
            yield StreamedSample(i, 0, SampleOutput([1], [-0.1], "stop", self.version))


@pytest.mark.parametrize("max_calls", [1, 8])
def test_groups_merge_only_for_an_engine_that_takes_one_call(max_calls: int) -> None:
    """Unseeded groups with equal params queued together: merged into one call for a
    one-call engine (torch); each its own call, at once, for a scheduling engine (vLLM)."""
    engine = CountingEngine(max_calls, hold_s=0.3)
    batcher = Batcher(engine, max_sequences=8, wait_s=0.05)
    threads = [
        threading.Thread(target=lambda i=i: list(batcher.submit([i + 1], SamplingParams())))
        for i in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    batcher.close()
    sizes = sorted(len(call) for call in engine.calls)
    if max_calls == 1:
        assert sum(sizes) == 4 and len(sizes) < 4  # merged (the first may go alone)
    else:
        assert sizes == [1, 1, 1, 1]


def test_an_engine_declaring_no_call_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one call"):
        Batcher(CountingEngine(0, 0.0), max_sequences=8)


def test_close_fails_the_requests_that_never_reached_the_engine() -> None:
    """A stopping server's queued calls end at once (UNAVAILABLE upstream): left waiting,
    their gRPC threads kept the process from exiting."""
    engine = HeldEngine(max_calls=1)
    batcher = Batcher(engine, max_sequences=64)
    outcomes: list[str] = []

    def call(seed: int) -> None:  # seeded: never merged, so one runs and two wait
        try:
            list(batcher.submit([1, 2], SamplingParams(n=1, max_tokens=1, seed=seed)))
            outcomes.append("done")
        except BatcherClosed:
            outcomes.append("closed")

    threads = [threading.Thread(target=call, args=(seed,)) for seed in range(3)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while (engine.running, batcher.pending()) != (1, 2) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (engine.running, batcher.pending()) == (1, 2)
    closer = threading.Thread(target=batcher.close)
    closer.start()
    engine.release.set()  # the call inside the engine still finishes
    for t in threads:
        t.join(timeout=10)
    closer.join(timeout=10)
    assert sorted(outcomes) == ["closed", "closed", "done"]
    with pytest.raises(BatcherClosed):
        list(batcher.submit([1], SamplingParams(n=1, max_tokens=1)))


class OrderedEngine(HeldEngine):
    """A one-call engine that records each call's prompts (first ids); its calls wait for
    `release`."""

    def __init__(self) -> None:
        super().__init__(max_calls=1)
        self.order: list[list[int]] = []

    def _samples(
        self, prompts: list[list[int]], params: SamplingParams, seed: int
    ) -> Iterator[StreamedSample]:
        self.order.append([p[0] for p in prompts])
        yield from super()._samples(prompts, params, seed)


def test_waiting_requests_reach_the_engine_by_priority_then_arrival() -> None:
    """The eval curve's calls (priority 1) pass training groups already queued (0) and
    merge among themselves; equal priorities keep their arrival order, a request read
    and put back by a merge (other params) included."""
    engine = OrderedEngine()
    batcher = Batcher(engine, max_sequences=4, wait_s=0.05)
    train, other = SamplingParams(n=1), SamplingParams(n=1, temperature=0.5)
    evals = SamplingParams(n=1, top_p=0.7)
    threads: list[threading.Thread] = []

    def start(first: int, params: SamplingParams, priority: int = 0) -> None:
        def call() -> None:
            list(batcher.submit([first], params, priority))

        threads.append(threading.Thread(target=call))
        threads[-1].start()
        deadline = time.monotonic() + 5
        while batcher.pending() + engine.running < len(threads) and time.monotonic() < deadline:
            time.sleep(0.005)

    start(1, train)
    deadline = time.monotonic() + 5
    while engine.running < 1 and time.monotonic() < deadline:  # in the engine, held
        time.sleep(0.005)
    for first, params, priority in [(2, train, 0), (3, other, 0), (4, evals, 1), (5, train, 0)]:
        start(first, params, priority)
    start(6, evals, 1)
    assert (engine.running, batcher.pending()) == (1, 5)
    engine.release.set()
    for t in threads:
        t.join(10)
    batcher.close()
    assert engine.order == [[1], [4, 6], [2], [3], [5]]


@pytest.mark.parametrize(
    ("engine", "most"),
    [
        ({"kind": "torch", "max_batch_size": 32, "merged_batches": 3}, 96),
        ({"kind": "torch", "max_batch_size": 32, "merged_batches": 1}, 64),  # a group: max_n
        ({"kind": "vllm"}, 64),  # each group its own call: a group at most
    ],
)
def test_a_merged_call_holds_up_to_merged_batches_buckets(engine: dict, most: int) -> None:
    from rollout.config import RolloutSettings
    from rollout.server import merged_sequences

    config = RolloutSettings.model_validate({"rollout": {"engine": engine}})
    assert merged_sequences(config) == most
