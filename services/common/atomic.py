"""Idempotent moves of a group between Redis keys, each one Lua script (atomic).

A write can be sent twice (redis-py resends a command whose connection broke; a
restarted service redoes its last move), so every move is keyed by the thing it consumes
and does nothing if that is already gone. The moves, their keys, and why long id lists
are acked in chunks: docs/reliability.md, "Idempotent moves".
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from services.common.keys import RunKeys

Fields = Mapping[str, bytes | str | int | float]

_ACK_THEN = """
local group, n = ARGV[1], tonumber(ARGV[2])
local acked = redis.call('XACK', KEYS[1], group, unpack(ARGV, 3, 2 + n))
if acked == 0 then return 0 end
local at, m = 3 + n, tonumber(ARGV[3 + n])
for i = at + 1, at + m do redis.call('HINCRBY', KEYS[3], ARGV[i], acked) end
if #ARGV > at + m then redis.call('XADD', KEYS[2], '*', unpack(ARGV, at + m + 1)) end
if m > 0 then redis.call('XADD', KEYS[4], 'MAXLEN', '~', 64, '*', 'n', acked) end
return acked
"""

# ARGV: group id, prompt id, pass rate, history length, then the stream entry's fields.
# The pass-rate history (a JSON list per prompt) is kept where the scores are known.
_PUBLISH = """
if redis.call('HDEL', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('XADD', KEYS[2], '*', unpack(ARGV, 5))
redis.call('HINCRBY', KEYS[3], 'scored', 1)
local raw = redis.call('HGET', KEYS[4], ARGV[2])
local history = raw and cjson.decode(raw) or {}
table.insert(history, tonumber(ARGV[3]))
while #history > tonumber(ARGV[4]) do table.remove(history, 1) end
redis.call('HSET', KEYS[4], ARGV[2], cjson.encode(history))
return 1
"""

_REJECT = """
if redis.call('HDEL', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('HINCRBY', KEYS[3], 'rejected:' .. ARGV[2], 1)
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '*', 'group_id', ARGV[1], 'reason', ARGV[2],
           unpack(ARGV, 4))
return 1
"""

_ADMIT = """
local new = redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2])
if new == 1 then redis.call('HINCRBY', KEYS[3], 'admitted', 1) end
redis.call('SET', KEYS[2], ARGV[3])
return new
"""


_COMMIT_STEP = """
if tonumber(redis.call('GET', KEYS[1]) or '0') >= tonumber(ARGV[1]) then return 0 end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('HINCRBY', KEYS[2], 'stepped', ARGV[2])
redis.call('XADD', KEYS[3], '*', 'json', ARGV[3])
redis.call('XADD', KEYS[4], '*', 'json', ARGV[4])
redis.call('XADD', KEYS[6], 'MAXLEN', '~', 64, '*', 'n', ARGV[2])
if #ARGV > 5 then
  local acked = redis.call('XACK', KEYS[5], ARGV[5], unpack(ARGV, 6))
  redis.call('HINCRBY', KEYS[2], 'trained', acked)
end
return 1
"""

CHUNK = 1000


def ledger_changes(ledger_key: str) -> str:
    """The capped stream every move that frees admission appends to (a buffer decision, a
    learner ack or step): the controller blocks on it instead of polling the ledger."""
    return f"{ledger_key}:changes"


def _flat(fields: Fields) -> list[bytes | str | int | float]:
    return [x for kv in fields.items() for x in kv]


def ack_then(
    client: redis.Redis,
    stream: str,
    group: str,
    ids: Sequence[str],
    ledger_key: str,
    counters: Iterable[str] = (),
    out_stream: str | None = None,
    fields: Fields | None = None,
) -> int:
    """Ack ids; by as many as were acked, bump counters and (if any) append fields.

    Returns the number acked: 0 means this move already happened (a replay).
    """
    names = list(counters)
    if not ids:
        return 0
    if len(ids) > CHUNK and not fields:
        return sum(
            ack_then(client, stream, group, ids[i : i + CHUNK], ledger_key, names)
            for i in range(0, len(ids), CHUNK)
        )
    return int(_ack_then(client, stream, group, ids, ledger_key, names, out_stream, fields))


def queue_ack_then(
    pipe: redis.client.Pipeline,
    stream: str,
    group: str,
    entry_id: str,
    ledger_key: str,
    counters: Iterable[str],
    out_stream: str | None,
    fields: Fields | None,
) -> None:
    """Queue one entry's `ack_then` on a pipeline (its result comes from `execute`)."""
    _ack_then(pipe, stream, group, [entry_id], ledger_key, list(counters), out_stream, fields)


def _ack_then(
    client: redis.Redis | redis.client.Pipeline,
    stream: str,
    group: str,
    ids: Sequence[str],
    ledger_key: str,
    names: list[str],
    out_stream: str | None,
    fields: Fields | None,
) -> Any:
    """Run the ack-then script: an int reply, or a pipeline when queued on one."""
    args = [group, len(ids), *ids, len(names), *names]
    if out_stream is not None and fields:
        args += _flat(fields)
    keys = [stream, out_stream or stream, ledger_key, ledger_changes(ledger_key)]
    return client.register_script(_ACK_THEN)(keys=keys, args=args)


@dataclass(frozen=True)
class PassRate:
    """A published group's pass rate, appended to its prompt's history (the last `keep`)."""

    prompt_id: str
    rate: float
    keep: int


def publish_inflight(
    client: redis.Redis, keys: RunKeys, group_id: str, fields: Fields, pass_rate: PassRate
) -> bool:
    """Move a group from `inflight` to `scored` (+1 `scored`) and record its pass rate;
    False if already moved (then nothing is recorded twice)."""
    return publish_inflight_many(client, keys, [(group_id, fields, pass_rate)])[0]


def publish_inflight_many(
    client: redis.Redis, keys: RunKeys, items: Sequence[tuple[str, Fields, PassRate]]
) -> list[bool]:
    """publish_inflight for each (group id, fields, pass rate), in order, in one round
    trip: each move is atomic alone, as when made one by one."""
    script = client.register_script(_PUBLISH)
    names = [keys.inflight, keys.scored, keys.ledger, keys.pass_rates]
    pipe = client.pipeline(transaction=False)
    for group_id, fields, pass_rate in items:
        rate = pass_rate.prompt_id, round(pass_rate.rate, 4), pass_rate.keep
        script(keys=names, args=[group_id, *rate, *_flat(fields)], client=pipe)
    return [bool(reply) for reply in pipe.execute()]


def reject_inflight(
    client: redis.Redis,
    keys: RunKeys,
    group_id: str,
    reason: str,
    fields: Fields,
    retain: int = 10_000,
) -> bool:
    """Move a group from `inflight` to the capped `rejected` stream (+1 `rejected:<reason>`);
    False if it already left `inflight`."""
    script = client.register_script(_REJECT)
    names = [keys.inflight, keys.rejected, keys.ledger]
    return bool(script(keys=names, args=[group_id, reason, retain, *_flat(fields)]))


def admit_inflight(
    client: redis.Redis,
    inflight: str,
    cursor_key: str,
    ledger_key: str,
    group_id: str,
    meta: str,
    cursor: str,
) -> bool:
    """Record a group in flight (+1 `admitted` if new) and move the cursor."""
    return admit_inflight_many(
        client, inflight, cursor_key, ledger_key, [(group_id, meta, cursor)]
    )[0]


def admit_inflight_many(
    client: redis.Redis,
    inflight: str,
    cursor_key: str,
    ledger_key: str,
    items: Sequence[tuple[str, str, str]],
) -> list[bool]:
    """admit_inflight for each (group id, meta, cursor), in order, in one round trip."""
    script = client.register_script(_ADMIT)
    pipe = client.pipeline(transaction=False)
    for group_id, meta, cursor in items:
        script(keys=[inflight, cursor_key, ledger_key], args=[group_id, meta, cursor], client=pipe)
    return [bool(reply) for reply in pipe.execute()]


def commit_step(
    client: redis.Redis,
    keys: RunKeys,
    version: int,
    stepped: int,
    metrics_json: str,
    trace_json: str,
    ack: tuple[str, Sequence[str]] | None = None,
) -> bool:
    """Publish a step: version, pacing counter, metrics, trace (+ acks); once per version."""
    args: list[str | int] = [version, stepped, metrics_json, trace_json]
    if ack is not None and ack[1]:
        args += [ack[0], *ack[1]]
    script = client.register_script(_COMMIT_STEP)
    names = [keys.version, keys.ledger, keys.metrics, keys.steps, keys.train]
    names.append(ledger_changes(keys.ledger))
    return bool(script(keys=names, args=args))
