"""Prometheus metrics of one rollout server, in its own registry.

A registry per server (not the process-global one) keeps several servers in one process
(tests, benchmarks) from mixing their numbers, and lets gauges read live state.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector


class RateMeter:
    """Events per second over a sliding window (e.g. tokens/s over the last 10 s)."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._events: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()

    def add(self, count: int) -> None:
        with self._lock:
            self._events.append((time.monotonic(), count))

    def rate(self) -> float:
        now = time.monotonic()
        with self._lock:
            while self._events and self._events[0][0] < now - self.window_s:
                self._events.popleft()
            return sum(c for _, c in self._events) / self.window_s


class RolloutMetrics:
    """Throughput, load, queue, cache use and weight updates of one server."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        r = self.registry
        self.tokens = Counter("dapo_rollout_tokens_generated", "Tokens generated", registry=r)
        self.samples = Counter(
            "dapo_rollout_samples", "Samples generated", ["finish_reason"], registry=r
        )
        self.rejected = Counter(
            "dapo_rollout_requests_rejected", "GenerateGroup calls refused", ["reason"], registry=r
        )
        self.tokens_per_s = Gauge(
            "dapo_rollout_tokens_per_second", "Tokens/s over the last 10 s", registry=r
        )
        self.in_flight = Gauge(
            "dapo_rollout_requests_in_flight", "GenerateGroup calls being served", registry=r
        )
        self.queue = Gauge(
            "dapo_rollout_queue_depth", "Requests waiting for the engine", registry=r
        )
        self.running = Gauge(
            "dapo_rollout_running_sequences", "Sequences in the engine call now", registry=r
        )
        self.version = Gauge("dapo_rollout_policy_version", "Policy version served", registry=r)
        self.weight_seconds = Histogram(
            "dapo_rollout_weight_update_seconds",
            "Receive/fetch + load of one update",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
            registry=r,
        )
        self.weight_failures = Counter(
            "dapo_rollout_weight_update_failures", "Updates rejected or failed", registry=r
        )
        self.rate = RateMeter()
        self.tokens_per_s.set_function(self.rate.rate)

    def cache_usage(self, read: Callable[[], float]) -> None:
        """Export KV-cache use (0..1) for engines that know it (the torch engine does not)."""
        Gauge(
            "dapo_rollout_kv_cache_usage", "Fraction of the KV cache in use", registry=self.registry
        ).set_function(read)

    def model_cpu(self, read: Callable[[], float]) -> None:
        """Export the CPU seconds of the engine's model work, where the engine measures it."""
        Gauge(
            "dapo_rollout_model_cpu_seconds",
            "CPU seconds the model's work took in this process",
            registry=self.registry,
        ).set_function(read)

    def generated(self, tokens: int, finish_reasons: Mapping[str, int]) -> None:
        """One group's (or call's) samples: their tokens and how many ended each way."""
        self.tokens.inc(tokens)
        for reason, count in finish_reasons.items():
            self.samples.labels(reason).inc(count)
        self.rate.add(tokens)
