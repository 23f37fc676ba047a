"""Cross-request batching: hands concurrent GenerateGroup calls to the engine the way the
engine declares it takes them (`RolloutEngine.max_concurrent_calls`).

One call at a time (torch): groups with equal sampling params share one merged call.
Many calls (vLLM): each group is its own call, handed over as it arrives. Waiting
requests go to the engine by priority, then in arrival order (the eval curve's calls
pass queued training groups). Samples reach their caller as the engine yields them; a
failed merged call is retried per request.
Details: docs/architecture.md, "The rollout server".
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from rollout.engine import RolloutEngine, SamplingParams, StreamedSample

_DONE = object()
_CLOSE_RANK = -(2**31)  # the close sentinel passes every request: they all fail alike


class BatcherClosed(RuntimeError):
    """The server is stopping: this request never reached the engine (retry elsewhere)."""


@dataclass
class _Request:
    prompt: list[int]
    params: SamplingParams
    # SimpleQueue (C): a queue.Queue's three Conditions cost more than a tiny model's
    # sampling of the prompt, made for every prompt (py-spy: 10% of the rollout's GIL time)
    out: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    cancelled: bool = False
    priority: int = 0
    arrival: int = 0  # its place among equal priorities, kept when put back


class Stream:
    """One submitted prompt's samples, as they finish (raises the engine's errors).
    close() (or leaving an iteration early) drops it if it has not reached the engine."""

    def __init__(self, request: _Request) -> None:
        self._request = request

    def __iter__(self) -> Iterator[StreamedSample]:
        try:
            while (item := self._request.out.get()) is not _DONE:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.close()  # a no-op once done; skips it if still queued

    def close(self) -> None:
        self._request.cancelled = True


class Batcher:
    """One worker thread that drains a queue of requests into batched engine calls."""

    def __init__(self, engine: RolloutEngine, max_sequences: int, wait_s: float = 0.005):
        self.engine, self.max_sequences, self.wait_s = engine, max_sequences, wait_s
        self.running = 0  # sequences in engine calls now
        calls = engine.max_concurrent_calls
        if calls < 1:
            raise ValueError(f"an engine takes at least one call at a time, got {calls}")
        self._merges = calls == 1  # an engine that schedules calls itself gets each alone
        self._calls = threading.Semaphore(calls)
        self._running_lock = threading.Lock()
        # (-priority, arrival, request): higher priority first, FIFO within one
        self._queue: queue.PriorityQueue[tuple[int, int, _Request | None]] = queue.PriorityQueue()
        self._arrivals = itertools.count()
        self._closed = False  # the close sentinel was read
        self._closing = False  # close() was called: no new engine call starts
        self._closing_lock = threading.Lock()  # no request slips in while close drains
        self._thread = threading.Thread(target=self._loop, daemon=True, name="batcher")
        self._thread.start()

    def submit(self, prompt: Sequence[int], params: SamplingParams, priority: int = 0) -> Stream:
        """Queue one prompt now (raises BatcherClosed when stopping); the Stream yields its
        samples as they finish. Queued at once, not when first read: a caller with several
        prompts submits them all before it reads any, so they can share an engine call."""
        request = _Request(list(prompt), params, priority=priority)
        with self._closing_lock:
            if self._closing:
                raise BatcherClosed("the rollout server is stopping")
            self._put(request)
        return Stream(request)

    def _put(self, request: _Request | None) -> None:
        if request is None:
            self._queue.put((_CLOSE_RANK, next(self._arrivals), None))
            return
        request.arrival = next(self._arrivals)
        self._put_back(request)

    def _put_back(self, request: _Request) -> None:
        """Queue `request` at its place: a request read but left for the next call keeps
        its turn, and a later one of higher priority still passes it."""
        self._queue.put((-request.priority, request.arrival, request))

    def pending(self) -> int:
        """Requests waiting for their engine call."""
        return self._queue.qsize()

    def close(self) -> None:
        """Stop taking calls; every request not yet in an engine call fails with
        BatcherClosed. (Left waiting, their gRPC handler threads kept a stopped server's
        process from exiting: the interpreter joins them at exit.)"""
        with self._closing_lock:
            self._closing = True
        self._put(None)
        self._thread.join(timeout=5)
        waiting = []
        while True:
            try:
                _, _, item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                waiting.append(item)
        for request in waiting:
            request.out.put(BatcherClosed("the rollout server stopped before this call ran"))
            request.out.put(_DONE)

    def _next(self, timeout: float | None) -> _Request | None:
        """The next live request (None on close); raises queue.Empty after `timeout`."""
        while True:
            _, _, item = self._queue.get(timeout=timeout)
            if item is None:
                self._closed = True
                return None
            if not item.cancelled:
                return item

    def _take_batch(self, first: _Request) -> list[_Request]:
        """`first` plus queued requests with the same params, up to max_sequences, when
        the engine runs one call at a time; else `first` alone.

        Seeded requests run alone: a prompt's random stream depends on its index in the
        engine call, so merging would break reproducibility.
        """
        batch, budget = [first], self.max_sequences - first.params.n
        mergeable = self._merges and first.params.seed is None
        while mergeable and budget > 0 and not self._closed:
            try:
                nxt = self._next(self.wait_s)
            except queue.Empty:
                break
            if nxt is None:
                break
            if nxt.params.seed is not None or nxt.params != first.params or nxt.params.n > budget:
                self._put_back(nxt)
                break
            batch.append(nxt)
            budget -= nxt.params.n
        return batch

    def _loop(self) -> None:
        """Wait for a free call first: until then requests stay queued (`pending`)."""
        while True:
            self._calls.acquire()
            if self._closing:
                return
            batch = self._next_batch()
            if batch is None:
                return
            threading.Thread(target=self._run_call, args=(batch,), daemon=True).start()

    def _next_batch(self) -> list[_Request] | None:
        """The next merged call's requests (None once closed)."""
        if self._closed:
            return None
        first = self._next(None)
        if first is None:
            return None
        return self._take_batch(first)

    def _run_call(self, batch: list[_Request]) -> None:
        try:
            self._run(batch)
        finally:
            self._calls.release()

    def _run(self, batch: list[_Request]) -> None:
        n = sum(r.params.n for r in batch)
        with self._running_lock:
            self.running += n
        try:
            sent, error = self._deliver(batch)
        finally:
            with self._running_lock:
                self.running -= n
        if error is not None and not sent and len(batch) > 1:
            for request in batch:  # nothing reached anyone yet: find the culprit alone
                self._run([request])
            return
        for request in batch:
            if error is not None:
                request.out.put(error)
            request.out.put(_DONE)

    def _deliver(self, batch: list[_Request]) -> tuple[int, Exception | None]:
        """Stream one engine call to its callers: (samples sent, the error that ended it)."""
        sent = 0
        try:
            for sample in self.engine.stream([r.prompt for r in batch], batch[0].params):
                batch[sample.request_index].out.put(sample)
                sent += 1
        except Exception as exc:  # surfaced to each waiting caller
            return sent, exc
        return sent, None
