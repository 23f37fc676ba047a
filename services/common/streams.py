"""Redis Streams with consumer groups: the queues between controller, buffer and learner.

A consumer acknowledges an entry only once its output is durable. `forward_and_ack`
writes the output and acks the input in one MULTI/EXEC transaction, so a crash between
the two can neither lose nor duplicate a group.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import redis

Fields = Mapping[str, bytes | str | int | float]


@dataclass(frozen=True)
class Entry:
    """One stream entry: its id and raw fields."""

    id: str
    fields: dict[str, bytes]


def _entries(raw: Sequence[tuple[bytes, dict[bytes, bytes]]]) -> list[Entry]:
    return [
        Entry(eid.decode(), {k.decode(): v for k, v in fields.items()})
        for eid, fields in raw
        if fields is not None  # deleted entries come back as None
    ]


def add(client: redis.Redis, stream: str, fields: Fields) -> str:
    """Append an entry and return its id."""
    return client.xadd(stream, dict(fields)).decode()


class StreamConsumer:
    """One member of a consumer group on one stream."""

    def __init__(self, client: redis.Redis, stream: str, group: str, consumer: str) -> None:
        self.client, self.stream, self.group, self.consumer = client, stream, group, consumer
        self.ensure_group()

    def ensure_group(self) -> None:
        """Create the group (and the stream) if needed, reading from the beginning."""
        try:
            self.client.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def read(self, count: int, block_ms: int | None = None) -> list[Entry]:
        """New entries for this consumer (they stay pending until acked)."""
        reply = self.client.xreadgroup(
            self.group, self.consumer, {self.stream: ">"}, count=count, block=block_ms
        )
        return _entries(reply[0][1]) if reply else []

    def read_own_pending(self, count: int, after: str = "0") -> list[Entry]:
        """Entries delivered to this consumer name but not acked (after a restart).

        `after` pages through them: pass the last id of the previous page.
        """
        reply = self.client.xreadgroup(self.group, self.consumer, {self.stream: after}, count=count)
        return _entries(reply[0][1]) if reply else []

    def reclaim(self, min_idle_ms: int, count: int = 100) -> list[Entry]:
        """Take over entries another (dead) consumer left pending for min_idle_ms."""
        reply = self.client.xautoclaim(
            self.stream, self.group, self.consumer, min_idle_ms, "0-0", count=count
        )
        return _entries(reply[1])

    def ack(self, ids: Sequence[str]) -> int:
        return int(self.client.xack(self.stream, self.group, *ids)) if ids else 0

    def pending(self) -> int:
        """Entries delivered to the group but not yet acked."""
        return int(self.client.xpending(self.stream, self.group)["pending"])

    def lag(self) -> int:
        """Entries not yet delivered to the group (None from old servers counts as 0)."""
        for info in self.client.xinfo_groups(self.stream):
            if info["name"].decode() == self.group:
                return int(info.get("lag") or 0)
        return 0


def forward_and_ack(
    consumer: StreamConsumer,
    entry_id: str,
    out_stream: str | None,
    fields: Fields | None,
    counters: Mapping[str, int] | None = None,
    ledger_key: str | None = None,
) -> None:
    """Atomically: optionally append to out_stream, bump ledger counters, ack entry_id."""
    forwards = [fields] if out_stream is not None and fields is not None else []
    forward_and_ack_many(consumer, [entry_id], out_stream, forwards, counters, ledger_key)


def forward_and_ack_many(
    consumer: StreamConsumer,
    entry_ids: Sequence[str],
    out_stream: str | None,
    forwards: Sequence[Fields],
    counters: Mapping[str, int] | None = None,
    ledger_key: str | None = None,
) -> None:
    """Atomically: append every `forwards` entry to out_stream, bump the counters, ack
    every id. One transaction for a whole read: all of it happens, or none."""
    pipe = consumer.client.pipeline(transaction=True)
    for fields in forwards if out_stream is not None else ():
        pipe.xadd(out_stream, dict(fields))
    for name, delta in (counters or {}).items():
        pipe.hincrby(ledger_key or "", name, delta)
    if entry_ids:
        pipe.xack(consumer.stream, consumer.group, *entry_ids)
    pipe.execute()


def _id(entry_id: bytes | str) -> tuple[int, int]:
    ms, _, seq = (entry_id.decode() if isinstance(entry_id, bytes) else entry_id).partition("-")
    return int(ms), int(seq or 0)


def acked_floor(client: redis.Redis, stream: str, group: str) -> tuple[int, int] | None:
    """The least id the group may still need: every older entry is acked (None: no group).

    Delivery is in id order, so entries up to `last-delivered-id` that are not pending
    have been acked, and nothing pending is older than the pending list's minimum.
    """
    info = next((i for i in client.xinfo_groups(stream) if i["name"].decode() == group), None)
    if info is None:
        return None
    ms, seq = _id(info["last-delivered-id"])
    floor = (ms, seq + 1)
    pending = client.xpending(stream, group)
    if pending["pending"]:
        floor = min(floor, _id(pending["min"]))
    return floor


def trim_acked(client: redis.Redis, stream: str, group: str, retain: int) -> int:
    """Delete the group's acked entries except the newest `retain`; returns how many.

    Unacked and undelivered entries are never touched, so consumer-group state (and the
    ledger's pending counts built on it) is exactly what it was.
    """
    if not client.exists(stream):
        return 0
    floor = acked_floor(client, stream, group)
    if floor is None:
        return 0
    if retain > 0:
        tail = client.xrevrange(stream, "+", "-", count=retain)
        if len(tail) < retain:
            return 0
        floor = min(floor, _id(tail[-1][0]))
    return int(client.xtrim(stream, minid=f"{floor[0]}-{floor[1]}", approximate=False))
