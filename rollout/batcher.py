"""Cross-request batching: concurrent Generate calls with equal sampling params share one
engine call, so a server keeps its cores busy when the controller sends many groups.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from rollout.engine import RolloutEngine, SamplingParams, StreamedSample

_DONE = object()


@dataclass
class _Request:
    prompt: list[int]
    params: SamplingParams
    out: queue.Queue = field(default_factory=queue.Queue)


class Batcher:
    """One worker thread that drains a queue of requests into batched engine calls."""

    def __init__(self, engine: RolloutEngine, max_sequences: int, wait_s: float = 0.005):
        self.engine, self.max_sequences, self.wait_s = engine, max_sequences, wait_s
        self._queue: queue.Queue[_Request | None] = queue.Queue()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, daemon=True, name="batcher")
        self._thread.start()

    def submit(self, prompt: Sequence[int], params: SamplingParams) -> Iterator[StreamedSample]:
        """Queue one prompt; yields its samples as they finish (raises engine errors)."""
        request = _Request(list(prompt), params)
        self._queue.put(request)
        while (item := request.out.get()) is not _DONE:
            if isinstance(item, BaseException):
                raise item
            yield item

    def pending(self) -> int:
        return self._queue.qsize()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)

    def _take_batch(self, first: _Request) -> tuple[list[_Request], _Request | None]:
        """`first` plus queued requests with the same params, up to max_sequences.

        Seeded requests run alone: a prompt's random stream depends on its index in the
        engine call, so merging would break reproducibility.
        """
        batch, budget, held = [first], self.max_sequences - first.params.n, None
        if first.params.seed is not None:
            return batch, None
        while budget > 0:
            try:
                nxt = self._queue.get(timeout=self.wait_s)
            except queue.Empty:
                break
            if nxt is None:
                self._closed = True
                break
            if nxt.params.seed is not None or nxt.params != first.params or nxt.params.n > budget:
                held = nxt
                break
            batch.append(nxt)
            budget -= nxt.params.n
        return batch, held

    def _loop(self) -> None:
        held: _Request | None = None
        while not (self._closed and held is None):
            first = held if held is not None else self._queue.get()
            if first is None:
                return
            batch, held = self._take_batch(first)
            self._run(batch)

    def _run(self, batch: list[_Request]) -> None:
        try:
            for sample in self.engine.stream([r.prompt for r in batch], batch[0].params):
                batch[sample.request_index].out.put(sample)
        except Exception as exc:  # surfaced to each waiting caller
            for r in batch:
                r.out.put(exc)
        finally:
            for r in batch:
                r.out.put(_DONE)
