"""Shared runtime against real processes: redis-server, Redis Streams, gRPC, HTTP."""

from __future__ import annotations

import random
import subprocess
import threading

import grpc
import httpx
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.errors import DapoError, PortInUseError
from services.common.grpc_server import insecure_channel, start_grpc_server
from services.common.http import create_http_app, serve_http
from services.common.keys import RunKeys
from services.common.ledger import unconsumed
from services.common.redis_server import RedisServer, connect, find_redis_server
from services.common.registry import Registration, discover
from services.common.server_config import ServerConfig
from services.common.streams import StreamConsumer, add, forward_and_ack, trim_acked


def test_redis_server_starts_answers_and_stops() -> None:
    server = RedisServer().wait_ready()
    client = redis.Redis.from_url(server.url)
    assert client.ping()
    pid = server.proc.pid
    server.stop()
    assert server.proc.poll() is not None
    with pytest.raises(ProcessLookupError):
        import os

        os.kill(pid, 0)


def test_redis_binary_is_found() -> None:
    out = subprocess.run([find_redis_server(), "--version"], capture_output=True, text=True)
    assert "Redis server" in out.stdout


def test_unreachable_redis_is_a_clear_error() -> None:
    from services.common.net import free_port

    with pytest.raises(DapoError, match="cannot reach Redis at redis://127.0.0.1"):
        connect(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.5)


def test_occupied_redis_port_fails_with_its_message(redis_server: RedisServer) -> None:
    with pytest.raises(DapoError, match="redis-server exited at start"):
        RedisServer(port=redis_server.port).wait_ready(timeout_s=5)


def test_consumer_group_acks_and_reclaims(redis_client: redis.Redis) -> None:
    ids = [add(redis_client, "s", {"n": str(i)}) for i in range(5)]
    dead = StreamConsumer(redis_client, "s", "g", "dead")
    got = dead.read(3)
    assert [e.id for e in got] == ids[:3] and dead.pending() == 3
    dead.ack([got[0].id])
    alive = StreamConsumer(redis_client, "s", "g", "alive")
    reclaimed = alive.reclaim(min_idle_ms=0)
    assert [e.id for e in reclaimed] == ids[1:3]
    assert [e.fields["n"] for e in alive.read(10)] == [b"3", b"4"]
    assert [e.id for e in alive.read_own_pending(10)] == ids[1:]


def test_forward_and_ack_moves_one_entry_with_its_counter(redis_client: redis.Redis) -> None:
    add(redis_client, "in", {"x": b"1"})
    add(redis_client, "in", {"x": b"2"})
    consumer = StreamConsumer(redis_client, "in", "g", "c")
    first, second = consumer.read(2)
    forward_and_ack(consumer, [(first.id, "kept", {"x": b"1"})], "out", "ledger")
    forward_and_ack(consumer, [(second.id, "filtered:all_wrong", None)], "out", "ledger")
    assert redis_client.xlen("out") == 1 and consumer.pending() == 0
    assert redis_client.hgetall("ledger") == {b"kept": b"1", b"filtered:all_wrong": b"1"}


def test_trim_deletes_only_acked_entries_and_keeps_the_pending_count(
    redis_client: redis.Redis,
) -> None:
    ids = [add(redis_client, "t", {"n": str(i)}) for i in range(10)]
    assert trim_acked(redis_client, "t", "g", retain=0) == 0  # no group yet: nothing
    consumer = StreamConsumer(redis_client, "t", "g", "c")
    got = consumer.read(6)  # 6 delivered, 4 undelivered
    consumer.ack([got[0].id, got[1].id, got[3].id])  # got[2] stays pending
    before = unconsumed(redis_client, "t", "g")
    assert trim_acked(redis_client, "t", "g", retain=0) == 2  # only those before got[2]
    assert [e[0].decode() for e in redis_client.xrange("t")] == ids[2:]
    assert unconsumed(redis_client, "t", "g") == before == 7
    consumer.ack([got[2].id, got[4].id, got[5].id])
    assert trim_acked(redis_client, "t", "g", retain=5) == 3  # keeps the newest 5
    assert redis_client.xlen("t") == 5
    assert trim_acked(redis_client, "t", "g", retain=0) == 1  # the 4 undelivered stay
    assert [e.id for e in consumer.read(10)] == ids[6:]
    assert unconsumed(redis_client, "t", "g") == 4


def test_trim_never_drops_an_unacked_entry_and_keeps_the_newest(
    redis_client: redis.Redis,
) -> None:
    """Random adds, reads, out-of-order acks and trims on a real Redis: every trim deletes
    exactly the acked entries older than both the oldest unacked one and the newest
    `retain`, and never an entry that is pending or undelivered."""
    rng = random.Random(7)
    consumer = StreamConsumer(redis_client, "r", "g", "c")
    live: list[str] = []  # every entry's id still in the stream, oldest first
    unacked: set[str] = set()  # pending or not yet delivered
    pending: list[str] = []
    for _ in range(300):
        for _ in range(rng.randint(0, 4)):
            entry = add(redis_client, "r", {"n": b"x"})
            live.append(entry)
            unacked.add(entry)
        pending += [e.id for e in consumer.read(rng.randint(1, 4))]
        acked = [i for i in pending if rng.random() < 0.5]  # out of order
        consumer.ack(acked)
        pending = [i for i in pending if i not in acked]
        unacked -= set(acked)
        retain = rng.choice([0, 3, 10])
        oldest_unacked = next((k for k, i in enumerate(live) if i in unacked), len(live))
        expected = max(min(oldest_unacked, len(live) - retain), 0)
        assert trim_acked(redis_client, "r", "g", retain) == expected
        live = live[expected:]
        assert [e[0].decode() for e in redis_client.xrange("r")] == live
        assert unacked <= set(live)


def test_trim_within_the_retained_length_reads_nothing(redis_client: redis.Redis) -> None:
    """At most `retain` entries: one XLEN, no entry read (it re-read 1,000 every second)."""
    for i in range(20):
        add(redis_client, "q", {"n": str(i)})
    consumer = StreamConsumer(redis_client, "q", "g", "c")
    consumer.ack([e.id for e in consumer.read(20)])
    redis_client.config_resetstat()
    assert trim_acked(redis_client, "q", "g", retain=1000) == 0
    used = {k.removeprefix("cmdstat_") for k in redis_client.info("commandstats")}
    assert used <= {"xlen", "config", "info"}, used
    redis_client.config_resetstat()
    assert trim_acked(redis_client, "q", "g", retain=15) == 5
    stats = redis_client.info("commandstats")
    assert "cmdstat_xrevrange" not in stats
    assert stats["cmdstat_xrange"]["calls"] == 1  # inside the script: the 5 deleted and 1


def test_registry_expires_dead_instances(redis_client: redis.Redis) -> None:
    keys = RunKeys("t")
    live = Registration(redis_client, keys, "rollout", "a", {"address": "x:1"}, ttl_s=0.3).start()
    Registration(redis_client, keys, "rollout", "b", {"address": "y:2"}, ttl_s=0.3).refresh()
    assert [i["instance"] for i in discover(redis_client, keys, "rollout")] == ["a", "b"]
    threading.Event().wait(0.6)  # b never beats again; a does
    assert [i["instance"] for i in discover(redis_client, keys, "rollout")] == ["a"]
    live.update(ready=True)
    assert discover(redis_client, keys, "rollout")[0]["ready"] is True
    live.stop()
    assert discover(redis_client, keys, "rollout") == []


def test_http_app_standard_endpoints() -> None:
    ready = {"v": False}
    app = create_http_app("svc", ready=lambda: ready["v"], status=lambda: {"step": 3})
    server = serve_http(app)
    try:
        assert httpx.get(f"{server.url}/healthz").json()["status"] == "ok"
        assert httpx.get(f"{server.url}/readyz").status_code == 503
        ready["v"] = True
        assert httpx.get(f"{server.url}/readyz").status_code == 200
        assert "python_gc" in httpx.get(f"{server.url}/metrics").text
        assert httpx.get(f"{server.url}/status").json() == {"service": "svc", "step": 3}
        with pytest.raises(PortInUseError, match=str(server.port)):
            serve_http(create_http_app("other"), port=server.port)
    finally:
        server.stop()


def test_grpc_server_serves_health_and_refuses_busy_port() -> None:
    server, port = start_grpc_server(ServerConfig(), lambda s: None, ["dapo.v1.X"])
    try:
        stub = health_pb2_grpc.HealthStub(insecure_channel(f"127.0.0.1:{port}"))
        for name in ("", "dapo.v1.X"):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as err:
            stub.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=5)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(PortInUseError, match=str(port)):
            start_grpc_server(ServerConfig(grpc_port=port), lambda s: None, [])
    finally:
        server.stop(None)
