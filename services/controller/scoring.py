"""Batched scoring: the groups that finish generating at about the same time share one
Score call, instead of one reward round trip per group.

Each group still gets exactly its own results back: a merged request lists the groups'
items one group after another, the reward service answers in request order, and the
results are cut back at the same boundaries. A merged request respects the reward
service's limits (items per request, message size). A merged call refused as
INVALID_ARGUMENT is retried one group at a time, so one bad group fails alone.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import grpc

from dapo.v1 import reward_pb2

ScoreCall = Callable[[reward_pb2.ScoreRequest], reward_pb2.ScoreResponse]


@dataclass
class _Pending:
    request: reward_pb2.ScoreRequest
    size: int
    result: Future = field(default_factory=Future)


def merge(requests: list[reward_pb2.ScoreRequest]) -> reward_pb2.ScoreRequest:
    """One request holding every item of `requests`, in order."""
    return reward_pb2.ScoreRequest(items=[item for r in requests for item in r.items])


def split(
    response: reward_pb2.ScoreResponse, requests: list[reward_pb2.ScoreRequest]
) -> list[reward_pb2.ScoreResponse]:
    """Cut a merged response back into one response per request (ValueError if short)."""
    counts = [len(r.items) for r in requests]
    if len(response.results) != sum(counts):
        raise ValueError(f"{len(response.results)} results for {sum(counts)} items")
    out, start = [], 0
    for n in counts:
        out.append(reward_pb2.ScoreResponse(results=response.results[start : start + n]))
        start += n
    return out


def invalid_argument(exc: BaseException) -> bool:
    return isinstance(exc, grpc.RpcError) and exc.code() == grpc.StatusCode.INVALID_ARGUMENT


class ScoreBatcher:
    """One thread that turns queued per-group Score requests into merged calls."""

    def __init__(self, call: ScoreCall, max_items: int, max_bytes: int) -> None:
        self.call, self.max_items, self.max_bytes = call, max_items, max_bytes
        self._queue: queue.Queue[_Pending | None] = queue.Queue()
        self._held: _Pending | None = None
        self._thread = threading.Thread(target=self._loop, daemon=True, name="score-batcher")
        self._thread.start()

    def score(self, request: reward_pb2.ScoreRequest) -> reward_pb2.ScoreResponse:
        """This group's results (blocks; raises what the call raised)."""
        (answer,) = self.score_many([request])
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def score_many(
        self, requests: list[reward_pb2.ScoreRequest]
    ) -> list[reward_pb2.ScoreResponse | BaseException]:
        """Each group's results, or what its call raised: all are queued before any is
        awaited, so they share calls."""
        pending = [_Pending(r, r.ByteSize()) for r in requests]
        for p in pending:
            self._queue.put(p)
        return [p.result.exception() or p.result.result() for p in pending]

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)

    def _take(self, first: _Pending) -> list[_Pending]:
        """`first` plus what is already queued, within the limits (no waiting)."""
        batch, items, size = [first], len(first.request.items), first.size
        while True:
            try:
                nxt = self._queue.get_nowait()
            except queue.Empty:
                return batch
            if nxt is None:
                self._queue.put(None)  # close after this batch
                return batch
            items, size = items + len(nxt.request.items), size + nxt.size
            if items > self.max_items or size > self.max_bytes:
                self._held = nxt
                return batch
            batch.append(nxt)

    def _loop(self) -> None:
        while True:
            first, self._held = self._held, None
            if first is None:
                first = self._queue.get()
            if first is None:
                return
            self._run(self._take(first))

    def _run(self, batch: list[_Pending]) -> None:
        requests = [p.request for p in batch]
        try:
            responses = split(self.call(merge(requests)), requests)
        except Exception as exc:  # handed to each waiting group, which retries
            if len(batch) > 1 and invalid_argument(exc):
                for pending in batch:
                    self._run([pending])
                return
            for pending in batch:
                pending.result.set_exception(exc)
            return
        for pending, response in zip(batch, responses, strict=True):
            pending.result.set_result(response)
