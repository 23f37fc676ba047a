"""Fault injection: `kill -9` every process of a running `dapo up` in turn, then Redis.

One run of the tiny preset (real processes, real Redis with AOF): after each kill the
supervisor restarts the process and the run makes progress again; the ledger identity
holds at once; at the end no group was trained twice or lost, and a restarted rollout
server caught up to the published weights before it reported ready. Prints the time
from each kill to the next committed step (docs/reliability.md quotes it).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import redis
from dapo_cli import set_args
from run_audit import assert_trained_once, children_of, role_process, wait_for

from services.common.adapters import decode_group
from services.common.keys import RunKeys
from services.common.ledger import read_ledger
from services.common.redis_server import RedisServer, start_redis
from services.common.registry import discover
from services.tools.cli import up_argv
from services.tools.launcher import Launch

pytestmark = pytest.mark.slow

RUN = "faults"
STEPS = 14
BATCH = 16  # train_batch_groups of the tiny preset
KEYS = RunKeys(RUN)


def committed(client: redis.Redis) -> int:
    return int(client.xlen(KEYS.steps))


def kill_and_wait(client: redis.Redis, kill, timeout: float = 120) -> float:
    """kill(), then block until a step commits after it; seconds from kill to that step."""
    before = committed(client)
    started = time.monotonic()
    kill()
    wait_for(lambda: reads(lambda: committed(client) > before), timeout, "a step after the kill")
    return time.monotonic() - started


def reads(fn):
    """fn() or False while Redis is restarting."""
    try:
        return fn()
    except redis.ConnectionError:
        return False


def rollout_ids(client: redis.Redis) -> set[str]:
    return {i["instance"] for i in discover(client, KEYS, "rollout")}


class SuccessorWatch(threading.Thread):
    """Polls the registry for a rollout server that was not there before the kill, and
    notes the version it serves when first seen accepting work (the run goes on
    meanwhile). `accepting`, not `ready`: `ready` also drops after every learner step
    until the pull lands, so on a fast run it may be up only between two polls."""

    def __init__(self, client: redis.Redis) -> None:
        super().__init__(daemon=True)
        self.client, self.old = client, rollout_ids(client)
        self.ready_version: int | None = None
        self.halt = threading.Event()

    def run(self) -> None:
        while self.ready_version is None and not self.halt.wait(0.1):
            new = reads(
                lambda: [
                    i
                    for i in discover(self.client, KEYS, "rollout")
                    if i["instance"] not in self.old
                ]
            )
            if new and new[0]["accepting"]:
                self.ready_version = new[0]["version"]


def group_ids(client: redis.Redis, stream: str) -> Counter:
    return Counter(f[b"group_id"].decode() for _, f in client.xrange(stream))


def test_every_process_killed_in_turn_loses_and_duplicates_nothing(
    tmp_path: Path, tiny_model: Path, killed_tree_env: dict[str, str]
) -> None:
    run_dir = tmp_path / "run"
    options = ["--steps", str(STEPS), "--rollouts", "2"]
    sets = [
        f"shared.run_name={RUN}",
        "controller.eval.enabled=false",
        "learner.linger_s=0",
        "learner.checkpoint.every=2",
        # Full batches (the counts below): no generation budget.
        "learner.generation_budget=null",
        # Keep every acked entry: the audit below reads the whole `scored` stream,
        # and a run that admits more than the default 1000 groups would be trimmed.
        "buffer.stream_retain=1000000",
    ]
    with RedisServer(appendonly=True) as server:
        client = redis.Redis.from_url(server.url)
        proc = subprocess.Popen(
            [*up_argv(run_dir, tiny_model), *options, "--redis-url", server.url, *set_args(sets)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=killed_tree_env,
        )
        try:
            recovery, (version_at_kill, successor) = run_kills(run_dir, client, server)
            out, _ = proc.communicate(timeout=180)
        finally:
            proc.kill()
        assert proc.returncode == 0, out[-3000:]
        print("\nseconds from kill -9 to the next committed step:", json.dumps(recovery))
        for role in ("controller", "rollout-", "reward", "buffer", "learner"):
            assert f"restarted {role}" in out

        assert successor is not None, "the restarted rollout server never accepted work"
        assert successor >= version_at_kill >= 1  # caught up before it served

        ledger, trained = assert_trained_once(client, RUN, STEPS, BATCH)
        assert ledger.trained == STEPS * BATCH
        # No group published or forwarded twice, none lost: every admitted group id is in
        # `scored` once or still in flight, and every trained one went through `train`.
        scored = group_ids(client, KEYS.scored)
        assert max(scored.values()) == 1 and len(scored) == ledger.scored
        assert len(scored) + ledger.in_flight == ledger.admitted
        forwarded = Counter(
            decode_group(f[b"group"]).group_id for _, f in client.xrange(KEYS.train)
        )
        assert max(forwarded.values()) == 1 and len(forwarded) == ledger.kept
        assert set(trained) <= set(forwarded) <= set(scored)
        assert not children_of(run_dir)


def run_kills(run_dir: Path, client: redis.Redis, server: RedisServer):
    """Kill each process in turn, waiting for a committed step after each."""
    recovery: dict[str, float] = {}
    wait_for(lambda: committed(client) >= 1, 180, "the first step")
    # The rollout server first: its successor takes longest to be ready again, and the
    # other kills go on meanwhile (the other rollout server feeds the learner).
    version_at_kill = int(client.get(KEYS.version) or 0)
    watch = SuccessorWatch(client)
    watch.start()
    recovery["rollout"] = kill_and_wait(client, role_process(run_dir, "rollout").kill)
    assert not read_ledger(client, RUN).problems()
    for role in ("learner", "controller", "reward", "buffer"):
        recovery[role] = kill_and_wait(client, role_process(run_dir, role).kill)
        assert not read_ledger(client, RUN).problems()
    watch.join(timeout=120)
    watch.halt.set()
    caught_up = (version_at_kill, watch.ready_version)

    def kill_redis() -> None:
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait()
        server.restart()

    recovery["redis"] = kill_and_wait(client, kill_redis)
    assert not read_ledger(client, RUN).problems()
    return recovery, caught_up


def test_launcher_restarts_its_redis_from_the_append_only_file(tmp_path: Path) -> None:
    from services.tools.config import load_config

    launch = Launch(load_config(preset="tiny", env={}), tmp_path)
    launch.redis_server = start_redis(appendonly=True)
    try:
        client = redis.Redis.from_url(launch.redis_server.url)
        client.xadd("s", {"x": 1})
        assert not launch.redis_died()
        launch.redis_server.proc.kill()
        launch.redis_server.proc.wait()
        assert launch.redis_died()
        assert client.xlen("s") == 1  # the write survived the SIGKILL
    finally:
        launch.redis_server.stop()
