"""The ledger identities: where every admitted group is, checked against the streams themselves.

    admitted = in_flight + scored + rejected           (controller)
    scored   = kept + filtered + pending_scored        (buffer)
    kept     = trained + dropped + pending_train       (learner)

Counters move in the same Redis transactions as the groups and pending counts come from
the consumer groups, so a mismatch means a bug (or a group lost), never a race
(docs/architecture.md, "Nothing is lost").
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import redis

from services.common.keys import RunKeys

BUFFER_GROUP, LEARNER_GROUP = "buffer", "learner"


def _queue_stream_state(pipe: Any, stream: str) -> None:
    pipe.xinfo_groups(stream)
    pipe.xinfo_stream(stream)


def _unconsumed(client: redis.Redis, stream: str, group: str, groups: Any, info: Any) -> int:
    """From a snapshot of the stream's groups and last id: unacked entries at that instant.

    Entries after the snapshot's last id are not counted (they did not exist then), so the
    count agrees with counters read in the same MULTI.
    """
    if isinstance(info, Exception):  # no such stream yet
        return 0
    last = info["last-generated-id"].decode()
    for g in groups:
        if g["name"].decode() == group:
            delivered = g["last-delivered-id"].decode()
            return int(g["pending"]) + len(client.xrange(stream, min=f"({delivered}", max=last))
    return len(client.xrange(stream, max=last))  # group not created yet: nothing consumed


def unconsumed(client: redis.Redis, stream: str, group: str) -> int:
    """Entries of `stream` the group has not acked: delivered-but-pending plus undelivered."""
    pipe = client.pipeline(transaction=True)
    _queue_stream_state(pipe, stream)
    groups, info = pipe.execute(raise_on_error=False)
    return _unconsumed(client, stream, group, groups, info)


@dataclass
class Ledger:
    admitted: int = 0
    in_flight: int = 0
    scored: int = 0
    kept: int = 0
    filtered: dict[str, int] = field(default_factory=dict)
    pending_scored: int = 0
    trained: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    pending_train: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    version: int = 0
    dataset: dict[str, Any] = field(default_factory=dict)

    @property
    def filtered_total(self) -> int:
        return sum(self.filtered.values())

    @property
    def dropped_total(self) -> int:
        return sum(self.dropped.values())

    @property
    def rejected_total(self) -> int:
        return sum(self.rejected.values())

    @property
    def stale_dropped(self) -> int:
        """Informative groups lost past the hard staleness bound (buffer + learner)."""
        return self.filtered.get("stale", 0) + self.dropped.get("stale", 0)

    @property
    def stale_drop_rate(self) -> float:
        """`stale_dropped` over every informative group decided (kept or dropped stale)."""
        informative = self.kept + self.filtered.get("stale", 0)
        return self.stale_dropped / informative if informative else 0.0

    def problems(self) -> list[str]:
        """Every identity that does not hold, spelled out."""
        checks = [
            (
                "admitted = in_flight + scored + rejected",
                self.admitted,
                self.in_flight + self.scored + self.rejected_total,
            ),
            (
                "scored = kept + filtered + pending_scored",
                self.scored,
                self.kept + self.filtered_total + self.pending_scored,
            ),
            (
                "kept = trained + dropped + pending_train",
                self.kept,
                self.trained + self.dropped_total + self.pending_train,
            ),
        ]
        if self.dataset:
            filtered = sum(self.dataset["filtered"].values())
            rows, usable = self.dataset["rows"], self.dataset["usable"]
            checks.append(("dataset rows = usable + filtered", rows, usable + filtered))
        return [f"{name}: {lhs} != {rhs}" for name, lhs, rhs in checks if lhs != rhs]

    def as_dict(self) -> dict:
        return dict(
            asdict(self),
            ok=not self.problems(),
            problems=self.problems(),
            stale_dropped=self.stale_dropped,
            stale_drop_rate=self.stale_drop_rate,
        )


def read_ledger(client: redis.Redis, run: str) -> Ledger:
    """Snapshot the counters and stream state of a run (one MULTI: the identity holds at
    every instant, also while the services run)."""
    keys = RunKeys(run)
    pipe = client.pipeline(transaction=True)
    pipe.hgetall(keys.ledger)
    pipe.hlen(keys.inflight)
    pipe.get(keys.version)
    pipe.hgetall(keys.dataset)
    _queue_stream_state(pipe, keys.scored)
    _queue_stream_state(pipe, keys.train)
    counters_raw, in_flight, version, dataset, *streams = pipe.execute(raise_on_error=False)
    counters = {k.decode(): int(v) for k, v in counters_raw.items()}
    return Ledger(
        admitted=counters.get("admitted", 0),
        in_flight=int(in_flight),
        scored=counters.get("scored", 0),
        kept=counters.get("kept", 0),
        filtered=prefixed(counters, "filtered:"),
        pending_scored=_unconsumed(client, keys.scored, BUFFER_GROUP, *streams[:2]),
        trained=counters.get("trained", 0),
        dropped=prefixed(counters, "dropped:"),
        pending_train=_unconsumed(client, keys.train, LEARNER_GROUP, *streams[2:]),
        rejected=prefixed(counters, "rejected:"),
        version=int(version or 0),
        dataset=dataset_counts({k.decode(): int(v) for k, v in dataset.items()}),
    )


def dataset_counts(raw: dict[str, int]) -> dict[str, Any]:
    """The `dataset` hash as {rows, usable, filtered: {reason: n}} (empty if never written)."""
    if not raw:
        return {}
    return {
        "rows": raw.get("rows", 0),
        "usable": raw.get("usable", 0),
        "filtered": prefixed(raw, "filtered:"),
    }


def prefixed(counters: dict[str, int], prefix: str) -> dict[str, int]:
    """Counters under `prefix:`, keyed by the rest of their name."""
    return {k.removeprefix(prefix): v for k, v in counters.items() if k.startswith(prefix)}
