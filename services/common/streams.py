"""Redis Streams with consumer groups: the queues between controller, buffer and learner.

A consumer acknowledges an entry only once its output is durable. `forward_and_ack`
writes each entry's output and acks it in one atomic script, so a crash between the two can
neither lose nor duplicate a group, and a replayed forward writes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import redis

from services.common.atomic import queue_ack_then

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


def last_id(client: redis.Redis, stream: str) -> bytes:
    """The id of the stream's newest entry (0-0 when empty): where a reader that wants
    only what comes next starts its XREAD, with no race against an add in between."""
    entries = client.xrevrange(stream, count=1)
    return entries[0][0] if entries else b"0-0"


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


def forward_and_ack(
    consumer: StreamConsumer,
    moves: Sequence[tuple[str, str, Fields | None]],
    out_stream: str,
    ledger_key: str,
) -> int:
    """Per (entry id, counter, fields or None): ack the entry and, only if it was still
    pending, append `fields` to out_stream and bump the counter. One idempotent script per
    entry, all pipelined in one round trip; a replayed move writes nothing. Returns how
    many entries were acked."""
    pipe = consumer.client.pipeline(transaction=False)
    for entry_id, counter, fields in moves:
        target = out_stream if fields is not None else None
        queue_ack_then(
            pipe, consumer.stream, consumer.group, entry_id, ledger_key, [counter], target, fields
        )
    return sum(int(acked) for acked in pipe.execute())


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


# Delete the oldest entries below the floor ARGV[1] but keep the newest ARGV[2]: the cut is
# the floor, or the entry just past the XLEN - retain oldest if that comes first. Reads
# (inside Redis) only the entries it deletes plus one, never the retained ones.
_TRIM = """
local excess = redis.call('XLEN', KEYS[1]) - tonumber(ARGV[2])
if excess <= 0 then return 0 end
local below = redis.call('XRANGE', KEYS[1], '-', '(' .. ARGV[1], 'COUNT', excess + 1)
local cut = ARGV[1]
if #below > excess then cut = below[excess + 1][1] end
return redis.call('XTRIM', KEYS[1], 'MINID', cut)
"""


def trim_acked(client: redis.Redis, stream: str, group: str, retain: int) -> int:
    """Delete the group's acked entries except the newest `retain`; returns how many.

    Unacked and undelivered entries are never touched, so consumer-group state (and the
    ledger's pending counts built on it) is exactly what it was. A stream of at most
    `retain` entries costs one XLEN; otherwise the cut is made inside Redis by id
    (`XTRIM MINID`), reading only the entries it deletes (the buffer trims every second).
    """
    if client.xlen(stream) <= retain:  # also a stream that does not exist
        return 0
    floor = acked_floor(client, stream, group)
    if floor is None:
        return 0
    cut = f"{floor[0]}-{floor[1]}"
    return int(client.eval(_TRIM, 1, stream, cut, max(retain, 0)))
