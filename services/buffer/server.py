"""The buffer service: reads `scored`, forwards informative groups within the hard
staleness bound to `train`.

Forwarding, acking and the ledger counter of an entry happen in one Redis script that
does nothing if the entry was already acked, so every scored group is counted exactly
once as kept or filtered (by reason), even if this process dies at any point or a write
is replayed. A whole read goes in one pipelined round trip. Malformed entries are acked
and counted, never retried. A pure filter: pass rates are recorded by the controller's
publish, where the scores are known.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any, get_args

import redis
from prometheus_client import Counter, Gauge

from services.buffer.config import BufferSettings
from services.buffer.filters import FilterDecision, Reason, decide
from services.common.adapters import decode_group
from services.common.keys import RunKeys
from services.common.ledger import LEARNER_GROUP
from services.common.redis_server import connect_run
from services.common.service import LoopServer
from services.common.streams import Entry, StreamConsumer, forward_and_ack, trim_acked

log = logging.getLogger(__name__)

DECISIONS = Counter("dapo_buffer_groups_total", "Scored groups by decision", ["reason"])
for _reason in get_args(Reason):  # at 0 from the start: a panel shows 0, not "No data"
    DECISIONS.labels(_reason)
KEPT_RATIO = Gauge("dapo_buffer_kept_ratio", "Fraction kept over the recent window of groups")
CONSUMER_GROUP = "buffer"


class Buffer:
    """Dynamic-sampling filter between the `scored` and `train` streams."""

    def __init__(self, config: BufferSettings, client: redis.Redis, consumer: str = "buffer-0"):
        self.config, self.client = config, client
        self.keys = RunKeys(config.shared.run_name)
        self.consumer = StreamConsumer(client, self.keys.scored, CONSUMER_GROUP, consumer)
        self.counts: dict[str, int] = {}
        self.recent: deque[bool] = deque(maxlen=config.buffer.rate_window)
        self._last_warning = 0.0
        self._last_trim = 0.0

    def current_version(self) -> int:
        return int(self.client.get(self.keys.version) or 0)

    def classify(self, entry: Entry, version: int) -> FilterDecision:
        try:
            group = decode_group(entry.fields["group"])
        except (KeyError, ValueError):
            return FilterDecision(False, "malformed")
        return decide(
            group,
            group_size=self.config.shared.group_size,
            current_version=version,
            max_staleness=self.config.shared.max_staleness,
            metric=self.config.buffer.keep_metric,
            dynamic_sampling=self.config.buffer.dynamic_sampling,
            max_staleness_hard=self.config.shared.staleness_hard_bound,
        )

    def handle(self, entries: list[Entry]) -> None:
        """Decide every entry of a read, then forward+count+ack them in one round trip."""
        if not entries:
            return
        version = self.current_version()
        moves: list[tuple[str, str, dict[str, bytes] | None]] = []
        for entry in entries:
            decision = self.classify(entry, version)
            counter = "kept" if decision.keep else f"filtered:{decision.reason}"
            moves.append(
                (entry.id, counter, {"group": entry.fields["group"]} if decision.keep else None)
            )
            DECISIONS.labels(decision.reason).inc()
            self.counts[decision.reason] = self.counts.get(decision.reason, 0) + 1
            self.recent.append(decision.keep)
        forward_and_ack(self.consumer, moves, self.keys.train, self.keys.ledger)
        self.watch_rate()
        self.trim()

    def trim(self, force: bool = False) -> None:
        """Drop acked entries of `scored` and `train` (at most once per trim_interval_s)."""
        cfg = self.config.buffer
        if not force and time.monotonic() - self._last_trim < cfg.trim_interval_s:
            return
        self._last_trim = time.monotonic()
        for stream, group in ((self.keys.scored, CONSUMER_GROUP), (self.keys.train, LEARNER_GROUP)):
            trim_acked(self.client, stream, group, cfg.stream_retain)

    def watch_rate(self) -> None:
        """Export the recent kept ratio; say so (at most every 30 s) when it collapses.

        DAPO keeps sampling until a batch is full; with a low informative rate the run
        slows down instead of aborting, and this is where the user learns why.
        """
        ratio = sum(self.recent) / len(self.recent)
        KEPT_RATIO.set(ratio)
        cfg = self.config.buffer
        full = len(self.recent) == self.recent.maxlen
        if full and ratio < cfg.low_rate_warning and time.monotonic() - self._last_warning > 30:
            self._last_warning = time.monotonic()
            log.warning(
                "informative rate collapsed: %.1f%% of the last %d groups kept (%s); "
                "generation per trained group is %.0fx — the task may be solved or too hard",
                100 * ratio,
                len(self.recent),
                dict(self.counts),
                1 / max(ratio, 1e-9),
            )

    def run(self, stop: threading.Event) -> None:
        """Process own pending entries first (after a crash), then new ones."""
        self.handle(self.consumer.read_own_pending(self.config.buffer.read_count))
        while not stop.is_set() and not self.client.exists(self.keys.done):
            self.handle(self.consumer.read(self.config.buffer.read_count, block_ms=200))
        try:
            self.trim(force=True)  # the learner's last acks came after the last read
        except redis.RedisError as exc:
            log.info("final trim skipped: %s", exc)

    def status(self) -> dict[str, Any]:
        return {"decisions": dict(self.counts), "version": self.current_version()}


def create_server(config: BufferSettings, client: redis.Redis | None = None) -> LoopServer:
    """The buffer and its HTTP endpoints (start() serves them, wait() consumes `scored`)."""
    buffer = Buffer(config, client or connect_run(config))
    return LoopServer("buffer", buffer, config.buffer.server, config.security.auth)
