"""Retries with backoff, and Redis writes that a replay cannot duplicate (real Redis)."""

from __future__ import annotations

import json
import threading

import grpc
import pytest
import redis
from dapo_cli import DAPO

from services.common.atomic import (
    PassRate,
    ack_then,
    admit_inflight,
    commit_step,
    publish_inflight,
)
from services.common.keys import RunKeys
from services.common.ledger import read_ledger
from services.common.retry import Backoff, RetriesExhausted, call_with_retry, retryable_rpc
from services.common.streams import StreamConsumer, add, forward_and_ack


class Rpc(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code


def flaky(failures: list[Exception], result: str = "ok"):
    calls = []

    def fn() -> str:
        calls.append(1)
        if failures:
            raise failures.pop(0)
        return result

    return fn, calls


def test_backoff_delays_grow_exponentially_up_to_the_cap_with_full_jitter() -> None:
    top = list(Backoff(base_s=0.1, cap_s=0.5, attempts=6).delays(rng=lambda: 1.0))
    assert top == pytest.approx([0.1, 0.2, 0.4, 0.5, 0.5])  # 5 waits between 6 attempts
    assert list(Backoff(0.1, 0.5, 3).delays(rng=lambda: 0.0)) == [0.0, 0.0]
    half = list(Backoff(0.1, 0.5, 3).delays(rng=lambda: 0.5))
    assert half == pytest.approx([0.05, 0.1])


def test_retries_retryable_errors_then_returns() -> None:
    fn, calls = flaky([Rpc(grpc.StatusCode.UNAVAILABLE), ConnectionError("no server")])
    waits: list[float] = []
    retried: list[str] = []
    got = call_with_retry(
        fn,
        Backoff(0.1, 1.0),
        sleep=waits.append,
        rng=lambda: 1.0,
        on_retry=lambda exc, delay: retried.append(type(exc).__name__),
    )
    assert got == "ok" and len(calls) == 3
    assert waits == pytest.approx([0.1, 0.2])
    assert retried == ["Rpc", "ConnectionError"]


def test_a_bad_request_is_never_retried() -> None:
    fn, calls = flaky([Rpc(grpc.StatusCode.INVALID_ARGUMENT)])
    with pytest.raises(Rpc):
        call_with_retry(fn, Backoff(), sleep=lambda s: None)
    assert len(calls) == 1
    assert not retryable_rpc(ValueError("x")) and retryable_rpc(Rpc(grpc.StatusCode.UNAVAILABLE))


def test_attempts_deadline_and_stop_end_the_retries() -> None:
    fn, calls = flaky([ConnectionError("down")] * 10)
    with pytest.raises(RetriesExhausted):
        call_with_retry(fn, Backoff(attempts=3), sleep=lambda s: None)
    assert len(calls) == 3
    fn, calls = flaky([ConnectionError("down")] * 10)
    with pytest.raises(RetriesExhausted):  # the first wait (up to 10 s) would pass 1 s
        call_with_retry(fn, Backoff(base_s=10, cap_s=10), deadline_s=1.0, rng=lambda: 1.0)
    assert len(calls) == 1
    stop = threading.Event()
    fn, calls = flaky([ConnectionError("down")] * 10)
    with pytest.raises(RetriesExhausted):  # stopping during the backoff: no further attempt
        call_with_retry(
            fn, Backoff(base_s=60, cap_s=60), stop=stop, on_retry=lambda e, d: stop.set()
        )
    assert len(calls) == 1


# ------------------------------------------------------------- idempotent writes
def test_a_replayed_publish_does_not_duplicate_the_group(redis_client: redis.Redis) -> None:
    k = RunKeys("idem")
    assert admit_inflight(redis_client, k.inflight, k.cursor, k.ledger, "e0-0", "{}", "0:1")
    assert not admit_inflight(redis_client, k.inflight, k.cursor, k.ledger, "e0-0", "{}", "0:1")
    fields = {"group": b"bytes", "group_id": "e0-0"}
    rate = PassRate("p0", 0.25, keep=4)
    assert publish_inflight(redis_client, k, "e0-0", fields, rate)
    assert not publish_inflight(redis_client, k, "e0-0", fields, rate)
    assert redis_client.xlen(k.scored) == 1
    assert json.loads(redis_client.hget(k.pass_rates, "p0")) == [0.25]  # recorded once
    ledger = read_ledger(redis_client, "idem")
    assert (ledger.admitted, ledger.in_flight, ledger.scored) == (1, 0, 1)
    assert not ledger.problems()


def test_a_replayed_forward_and_ack_writes_nothing(redis_client: redis.Redis) -> None:
    add(redis_client, "in", {"x": b"1"})
    consumer = StreamConsumer(redis_client, "in", "g", "c")
    (entry,) = consumer.read(1)
    move = [(entry.id, "kept", {"x": b"1"})]
    assert forward_and_ack(consumer, move, "out", "ledger") == 1
    assert forward_and_ack(consumer, move, "out", "ledger") == 0
    assert redis_client.xlen("out") == 1
    assert redis_client.hgetall("ledger") == {b"kept": b"1"}


def test_a_replayed_batch_of_moves_writes_nothing(redis_client: redis.Redis) -> None:
    """The buffer's pipelined read: each move is its own idempotent script."""
    for i in range(3):
        add(redis_client, "in", {"x": i})
    consumer = StreamConsumer(redis_client, "in", "g", "c")
    entries = consumer.read(3)
    moves = [
        (entries[0].id, "kept", {"x": b"0"}),
        (entries[1].id, "filtered:all_wrong", None),
        (entries[2].id, "kept", {"x": b"2"}),
    ]
    assert forward_and_ack(consumer, moves[:1], "out", "ledger") == 1  # died after one
    assert forward_and_ack(consumer, moves, "out", "ledger") == 2  # the replay
    assert forward_and_ack(consumer, moves, "out", "ledger") == 0
    assert [e[1][b"x"] for e in redis_client.xrange("out")] == [b"0", b"2"]
    assert redis_client.hgetall("ledger") == {b"kept": b"2", b"filtered:all_wrong": b"1"}
    assert consumer.pending() == 0


def test_acks_count_each_entry_once_even_in_chunks(redis_client: redis.Redis) -> None:
    ids = [add(redis_client, "t", {"n": i}) for i in range(2500)]
    consumer = StreamConsumer(redis_client, "t", "g", "c")
    assert len(consumer.read(3000)) == 2500
    assert ack_then(redis_client, "t", "g", ids[:10], "ledger", ["trained"]) == 10
    assert ack_then(redis_client, "t", "g", ids, "ledger", ["trained"]) == 2490  # 3 chunks
    assert ack_then(redis_client, "t", "g", ids, "ledger", ["trained"]) == 0
    assert redis_client.hget("ledger", "trained") == b"2500" and consumer.pending() == 0


def test_a_replayed_step_commit_is_applied_once(redis_client: redis.Redis) -> None:
    k = RunKeys("step")
    ids = [add(redis_client, k.train, {"n": i}) for i in range(3)]
    StreamConsumer(redis_client, k.train, "learner", "l").read(3)
    for _ in range(2):
        commit_step(redis_client, k, 1, 3, '{"step": 1}', '{"step": 1}', ("learner", ids))
    assert redis_client.get(k.version) == b"1"
    assert redis_client.xlen(k.metrics) == 1 and redis_client.xlen(k.steps) == 1
    assert redis_client.hgetall(k.ledger) == {b"stepped": b"3", b"trained": b"3"}


# ------------------------------------------------------------- graceful shutdown
def test_sigterm_stops_the_controller_and_hands_back_its_groups(
    tiny_model, redis_server, redis_client: redis.Redis, tmp_path
) -> None:
    """No rollout server: every admitted group waits in a retry; SIGTERM ends the process
    at once and leaves the groups in flight, where the next controller re-runs them."""
    import signal
    import subprocess
    import sys
    import time

    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.tools.cli",
            "controller",
            "--preset",
            "tiny",
            "--redis-url",
            redis_server.url,
            "--set",
            "shared.run_name=graceful",
            "--set",
            f"shared.model_path={tiny_model}",  # its tokenizer renders the prompts
            "--set",
            "controller.max_groups_in_flight=4",
            "--set",
            "controller.server.http_port=0",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while read_ledger(redis_client, "graceful").admitted < 4 and time.monotonic() < deadline:
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
    ledger = read_ledger(redis_client, "graceful")
    assert (ledger.admitted, ledger.in_flight, ledger.scored) == (4, 4, 0)
    assert not ledger.problems()


def _serve_then_sigterm(role: str, args: list[str]) -> tuple[int, str]:
    """Start `dapo ROLE`, wait for its ready line, SIGTERM it; its exit code and output."""
    import signal
    import subprocess

    proc = subprocess.Popen(
        [*DAPO, role, "--http-port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        lines = []
        while not (lines and lines[-1].startswith(f"dapo {role} ready")):
            line = proc.stdout.readline().decode()  # type: ignore[union-attr]
            assert line, "".join(lines)  # it exited before it was ready
            lines.append(line)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        return code, "".join(lines) + proc.stdout.read().decode()  # type: ignore[union-attr]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_sigterm_stops_the_buffer_after_its_moves(redis_server, redis_client: redis.Redis) -> None:
    """SIGTERM between reads: the buffer exits 0 and every group it read is accounted for."""
    from learner_fixtures import make_groups

    from services.common.adapters import encode_group

    keys = RunKeys("graceful-buffer")
    for group in make_groups(n_groups=3):
        redis_client.hincrby(keys.ledger, "admitted", 1)
        redis_client.hincrby(keys.ledger, "scored", 1)
        add(redis_client, keys.scored, {"group": encode_group(group)})
    run = [
        "--redis-url",
        redis_server.url,
        "--set",
        "shared.run_name=graceful-buffer",
        "--set",
        "shared.group_size=4",
    ]
    code, output = _serve_then_sigterm("buffer", run)
    assert code == 0, output
    ledger = read_ledger(redis_client, "graceful-buffer")
    assert not ledger.problems(), ledger.as_dict()
    assert ledger.kept + ledger.filtered_total + ledger.pending_scored == 3


@pytest.mark.slow
def test_sigterm_stops_a_rollout_server(tiny_model, redis_server) -> None:
    """A rollout server with no learner yet (so never ready) still stops cleanly."""
    run = [
        "--grpc-port",
        "0",
        "--redis-url",
        redis_server.url,
        "--set",
        f"shared.model_path={tiny_model}",
        "--set",
        "shared.run_name=graceful-rollout",
    ]
    code, output = _serve_then_sigterm("rollout", run)
    assert code == 0, output
