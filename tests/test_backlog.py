"""The controller's `generating` stream (KEDA's scaling signal), written in batches: one
entry per group waiting for or in generation after each flush, none for a group that
came and went between two flushes, and nothing lost to a failed flush."""

from __future__ import annotations

import time

import redis

from services.common.keys import RunKeys
from services.controller.run_state import Backlog

KEYS = RunKeys("backlog")


def test_a_flush_adds_the_groups_generating_and_deletes_the_ones_that_left(
    redis_client: redis.Redis,
) -> None:
    backlog = Backlog(redis_client, KEYS)
    backlog.enter("a")
    backlog.enter("b")
    backlog.flush()
    assert redis_client.xlen(KEYS.generating) == 2
    backlog.leave("a")
    backlog.enter("c")
    backlog.leave("c")  # came and went between two flushes: never written
    backlog.flush()
    left = [f[b"group_id"] for _, f in redis_client.xrange(KEYS.generating)]
    assert left == [b"b"]
    backlog.leave("b")
    backlog.flush()
    assert redis_client.xlen(KEYS.generating) == 0


def test_a_failed_flush_is_done_by_the_next(redis_client: redis.Redis) -> None:
    backlog = Backlog(redis_client, KEYS)
    backlog.enter("a")
    backlog.flush()
    backlog.leave("a")
    backlog.enter("b")
    backlog.client = redis.Redis(port=1, socket_connect_timeout=0.2)  # nothing listens
    backlog.flush()  # fails: kept
    assert [f[b"group_id"] for _, f in redis_client.xrange(KEYS.generating)] == [b"a"]
    backlog.client = redis_client
    backlog.flush()
    assert [f[b"group_id"] for _, f in redis_client.xrange(KEYS.generating)] == [b"b"]


def test_the_flusher_writes_within_its_period_and_close_flushes(
    redis_client: redis.Redis,
) -> None:
    backlog = Backlog(redis_client, KEYS, every_s=0.02)
    backlog.start()
    try:
        backlog.enter("a")
        deadline = time.monotonic() + 5
        while redis_client.xlen(KEYS.generating) == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert redis_client.xlen(KEYS.generating) == 1
        backlog.leave("a")
    finally:
        backlog.close()
    assert redis_client.xlen(KEYS.generating) == 0
