"""Retry an idempotent call with exponential backoff and full jitter, within a deadline.

Only calls whose repetition cannot change the outcome belong here: gRPC reads
(GetVersion, FetchWeights), pure functions (Score), and sampling (GenerateGroup writes
nothing). Writes to Redis are made idempotent instead (services/common/atomic.py).

Full jitter (a uniform delay in [0, min(cap, base·2^n)]) spreads the retries of many
clients that failed together, e.g. every controller thread when a reward service restarts.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import grpc

T = TypeVar("T")

# Codes that say "try again" rather than "your request is wrong".
RETRYABLE_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.UNKNOWN,
    }
)


@dataclass(frozen=True)
class Backoff:
    """How to wait between attempts: base·2^n capped at cap, full jitter, at most attempts."""

    base_s: float = 0.1
    cap_s: float = 5.0
    attempts: int | None = None  # None: until the deadline or the stop event

    def delays(self, rng: Callable[[], float] = random.random) -> Iterator[float]:
        """The wait before attempt 2, 3, ...: uniform in [0, min(cap, base·2^n)]."""
        n = 0
        while self.attempts is None or n < self.attempts - 1:
            yield rng() * min(self.cap_s, self.base_s * 2**n)
            n += 1


def retryable_rpc(exc: BaseException) -> bool:
    """A gRPC error worth retrying (server gone, overloaded, too slow), or no server at all."""
    if isinstance(exc, grpc.RpcError):
        return exc.code() in RETRYABLE_CODES
    return isinstance(exc, ConnectionError)


class RetriesExhausted(Exception):
    """Every attempt failed, or the deadline or stop came first; wraps the last error."""


def call_with_retry(
    fn: Callable[[], T],
    backoff: Backoff,
    retryable: Callable[[BaseException], bool] = retryable_rpc,
    deadline_s: float | None = None,
    stop: threading.Event | None = None,
    on_retry: Callable[[BaseException, float], None] | None = None,
    sleep: Callable[[float], object] | None = None,
    rng: Callable[[], float] = random.random,
) -> T:
    """fn() until it succeeds; non-retryable errors propagate at once.

    Waits with `stop.wait` when a stop event is given, so a shutdown is never delayed by a
    backoff; raises RetriesExhausted when attempts, deadline or stop end the retries.
    """
    wait = sleep or (stop.wait if stop is not None else time.sleep)
    end = None if deadline_s is None else time.monotonic() + deadline_s
    delays = backoff.delays(rng)
    while True:
        if stop is not None and stop.is_set():
            raise RetriesExhausted("stopped")
        try:
            return fn()
        except Exception as exc:
            if not retryable(exc):
                raise
            delay = next(delays, None)
            late = end is not None and delay is not None and time.monotonic() + delay > end
            if delay is None or late:
                raise RetriesExhausted(str(exc)) from exc
            if on_retry is not None:
                on_retry(exc, delay)
            wait(delay)
