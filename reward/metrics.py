"""Prometheus metrics of the reward service (default registry, served at /metrics).

Module-level because prometheus-client registers each name once per process; several
servers in one process (tests) share them, so tests compare before/after values.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

ITEMS = Counter(
    "dapo_reward_items_total",
    "Items scored, by the verifier that decided and the outcome (correct/wrong/error/timeout)",
    ["verifier", "outcome"],
)
CORRECT_RATE = Gauge("dapo_reward_correct_rate", "Fraction of items correct in the last request")
TIMEOUTS = Counter("dapo_reward_timeouts_total", "Items whose worker was killed at the timeout")
ERRORS = Counter("dapo_reward_errors_total", "Items whose verification failed (not timeouts)")
VERIFY_SECONDS = Histogram(
    "dapo_reward_verify_seconds",
    "Time a worker spent on one item",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
REQUEST_SECONDS = Histogram(
    "dapo_reward_request_seconds", "Time to score one request", ["transport"]
)
POOL_RESTARTS = Counter(
    "dapo_reward_pool_restarts_total", "Verifier workers replaced, by reason", ["reason"]
)
# Each reason reward/pool.py gives, at 0 from the start: a panel shows 0, not "No data".
for _reason in ("died", "timeout"):
    POOL_RESTARTS.labels(_reason)
REJECTED = Counter("dapo_reward_rejected_requests_total", "Requests refused for a limit", ["limit"])


def sample_value(name: str, labels: dict[str, str] | None = None) -> float:
    """Current value of one sample in the default registry (0 if absent); for tests/status."""
    from prometheus_client import REGISTRY

    value = REGISTRY.get_sample_value(name, labels or {})
    return 0.0 if value is None else value
