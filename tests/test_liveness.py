"""`dapo up`'s liveness pieces against real parts: a stall shown with each service's latest
error read from its real /status endpoint, the stall timeout, a crash-looping service's
last words as the reason (the end-to-end runs are in tests/test_messy_data.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import redis
from tqdm import tqdm

from services.common.error_log import ErrorLog
from services.common.http import create_http_app, serve_http
from services.common.keys import RunKeys
from services.tools.config import load_config
from services.tools.launcher import Child, Launch, supervise
from services.tools.liveness import StallWatch, announced_http_port, run_failure


@dataclass
class Service:
    """A launched service as the watch sees it: a name, a pid and a log."""

    name: str
    pid: int
    log_path: Path


def test_the_stall_line_names_each_services_latest_error(
    tmp_path: Path, redis_client: redis.Redis
) -> None:
    errors = ErrorLog()
    app = create_http_app("controller", status=lambda: {"last_error": errors.snapshot()})
    server = serve_http(app)
    try:
        log = tmp_path / "controller.log"
        log.write_text(f"starting\ndapo controller ready http={server.port}\nmore\n")
        assert announced_http_port(log) == server.port
        silent = tmp_path / "learner.log"
        silent.write_text("loading the model\n")  # not ready yet: no port announced
        services = [Service("controller", 1, log), Service("learner", 2, silent)]
        redis_client.hset(RunKeys("r").ledger, mapping={"admitted": 5, "rejected:x": 5})
        watch = StallWatch(stall_after_s=0.2)
        watch.start()
        assert watch.observe(0, services, redis_client, "r") is None  # not stalled yet
        time.sleep(0.3)
        errors.record("rejected prompt_too_long", "prompt of 20 tokens exceeds ...=16")
        line = watch.observe(0, services, redis_client, "r")
        assert line is not None and line.startswith("no training step for 0s: ")
        assert "controller: rejected prompt_too_long ×1, 0s ago: prompt of 20 tokens" in line
        assert "learner: no answer on /status" in line
        assert line.endswith(
            "groups admitted 5, in flight 0, rejected 5, filtered 0, waiting to train 0"
        )
        time.sleep(0.3)
        errors.record("rejected prompt_too_long", "again")
        assert watch.observe(0, services, redis_client, "r") is None  # same cause: quiet
        errors.record("rollout UNAVAILABLE", "catching up")
        time.sleep(0.3)
        line = watch.observe(0, services, redis_client, "r")
        assert line is not None and "controller: rollout UNAVAILABLE ×1" in line
        assert watch.observe(1, services, redis_client, "r") is None  # a step: not stalled
    finally:
        server.stop()


def test_the_stall_timeout_gives_the_reason(tmp_path: Path) -> None:
    watch = StallWatch(stall_after_s=0.1, stall_timeout_s=0.2)
    watch.start()
    assert watch.timed_out(0) is None
    time.sleep(0.25)
    reason = watch.timed_out(0)
    assert reason is not None and reason.startswith("no training step for 0s (--stall-timeout)")
    assert watch.timed_out(1) is None and StallWatch(0.1).timed_out(0) is None


def test_a_run_a_service_gave_up_on(redis_client: redis.Redis) -> None:
    assert run_failure(redis_client, RunKeys("r")) is None
    redis_client.set(RunKeys("r").failed, "the last 256 groups were all rejected")
    assert run_failure(redis_client, RunKeys("r")) == "the last 256 groups were all rejected"


def test_a_crash_looping_service_stops_the_run_with_its_last_words(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    log_path = tmp_path / "logs" / "controller.log"
    log_file = log_path.open("ab")
    code = "print('starting'); print('dapo controller: error: data.parquet: missing columns: x')"
    proc = subprocess.Popen(
        [sys.executable, "-c", code + "; raise SystemExit(2)"],
        stdout=log_file,
        stderr=subprocess.STDOUT,
    )
    proc.wait(timeout=30)
    launch = Launch(load_config(preset="tiny", env={}), tmp_path, max_restarts=0)
    launch.children.append(Child("controller", proc, log_file, "controller"))
    with tqdm(disable=True) as bar:
        assert not supervise(launch, launch.children[0], bar)
    log_file.close()
    assert launch.failure == (
        "controller failed 1 times: dapo controller: error: data.parquet: missing columns: x"
    )


def test_the_stall_line_leads_with_the_outcome_of_the_last_seconds(
    redis_client: redis.Redis,
) -> None:
    """An old error does not lead the line: the groups of the last `stall_after_s`
    seconds, from the ledger's live counters, all filtered all_wrong."""
    keys = RunKeys("r")
    redis_client.hset(keys.ledger, mapping={"admitted": 40, "filtered:all_correct": 40})
    server = {"instance": "a", "accepting": True, "version": 0}
    redis_client.set(f"{keys.registry('rollout')}:a", json.dumps(server))
    watch = StallWatch(stall_after_s=0.3)
    watch.start()
    assert watch.observe(0, [], redis_client, "r") is None  # a sample of the counts
    redis_client.hincrby(keys.ledger, "admitted", 48)
    redis_client.hincrby(keys.ledger, "filtered:all_wrong", 48)
    time.sleep(0.4)
    line = watch.observe(0, [], redis_client, "r")
    assert line is not None, "stalled past stall_after_s"
    assert line.startswith("no training step for 0s: every group (48) filtered all_wrong in the")
