"""The learner as Kubernetes and compose launch it: 2 ranks under torchrun (CPU, gloo,
ZeRO-2), inside a live `dapo up --learner-ranks 2`.

- SIGTERM to torchrun (what a pod deletion or `docker stop` sends): every rank takes part
  in one checkpoint that holds every committed step, torchrun exits 143 well inside its
  shutdown timeout (no SIGKILL) and within the budget the learner logs for it, `dapo up`
  restarts it, the group resumes and the run finishes with the ledger exact and no
  policy version published twice.
- SIGKILL of rank 1 (a crash), with checkpoints written in the background: torchrun
  stops rank 0, restarts the whole group, which resumes from the last whole checkpoint,
  and the run finishes with the ledger exact.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import redis
from dapo_cli import DAPO, set_args
from run_audit import assert_trained_once, wait_for

from services.common.keys import RunKeys
from services.common.redis_server import RedisServer

pytestmark = pytest.mark.slow

STEPS, BATCH, SHUTDOWN_TIMEOUT_S = 10, 16, 60


def start_run(
    run_dir: Path,
    model: Path,
    server: RedisServer,
    run: str,
    env: dict,
    checkpoint_every: int,
    **more: object,
):
    sets = {
        "shared.model_path": model,
        "shared.run_name": run,
        "learner.deepspeed.zero_stage": 2,
        "controller.eval.enabled": "false",
        "learner.linger_s": 0,
        "learner.generation_budget": "null",  # full batches: the test counts them
        "learner.checkpoint.every": checkpoint_every,
        "learner.launch.shutdown_timeout_s": SHUTDOWN_TIMEOUT_S,
        **more,
    }
    cmd = [*DAPO, "up", "--preset", "tiny"]
    cmd += ["--run-dir", str(run_dir), "--steps", str(STEPS), "--learner-ranks", "2"]
    cmd += ["--redis-url", server.url]
    cmd += set_args(f"{k}={v}" for k, v in sets.items())
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )


def torchrun_of(run_dir: Path) -> psutil.Process:
    """The learner's torchrun (the process `dapo up` started as `dapo learner`)."""
    marker = str(run_dir / "config.yaml")
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if "learner.launch" in cmdline and marker in cmdline:
            return proc
    raise AssertionError("no torchrun for the learner")


def rank(torchrun: psutil.Process, number: int) -> psutil.Process:
    for child in torchrun.children():
        if child.environ().get("RANK") == str(number):
            return child
    raise AssertionError(f"no rank {number}")


def committed(client: redis.Redis, keys: RunKeys) -> int:
    return int(client.xlen(keys.steps))


def check_finished_exactly(client: redis.Redis, run: str) -> None:
    """Every step once in the final model, every group trained once, versions unique."""
    keys = RunKeys(run)
    ledger, _ = assert_trained_once(client, run, STEPS, BATCH)
    assert ledger.trained == STEPS * BATCH
    versions = [json.loads(f[b"json"])["version"] for _, f in client.xrange(keys.steps)]
    assert len(versions) == len(set(versions)), versions  # no version published twice


def run_with_fault(
    server: RedisServer,
    tmp_path: Path,
    model: Path,
    env: dict,
    checkpoint_every: int,
    fault,
    **sets: object,
):
    """`dapo up` with a 2-rank learner; after 3 steps `fault(torchrun, client, keys)`, then
    wait for the end: (out, exit code, learner log, what `fault` returned, client, run)."""
    run, run_dir = tmp_path.name[-12:], tmp_path / "run"
    keys = RunKeys(run)
    client = redis.Redis.from_url(server.url)
    proc = start_run(run_dir, model, server, run, env, checkpoint_every, **sets)
    try:
        wait_for(lambda: committed(client, keys) >= 3, 300, "3 steps")
        seen = fault(torchrun_of(run_dir), client, keys)
        out, _ = proc.communicate(timeout=420)
    finally:
        proc.kill()
    log = (run_dir / "logs" / "learner.log").read_text()
    return out, proc.returncode, log, seen, client, run


def test_sigterm_to_torchrun_checkpoints_on_every_rank_then_resumes(
    tmp_path: Path, tiny_model: Path, killed_tree_env: dict[str, str]
) -> None:
    def sigterm(torchrun: psutil.Process, client: redis.Redis, keys: RunKeys) -> tuple:
        ranks = [rank(torchrun, 0), rank(torchrun, 1)]
        torchrun.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        torchrun.wait(timeout=SHUTDOWN_TIMEOUT_S + 30)  # (not our child: no exit code)
        assert not any(r.is_running() for r in ranks)
        return time.monotonic() - sent, committed(client, keys)

    with RedisServer(appendonly=True) as server:
        out, code, log, (stopped_s, at_stop), client, run = run_with_fault(
            server, tmp_path, tiny_model, killed_tree_env, 100, sigterm
        )
        assert code == 0, out[-3000:]
        assert stopped_s < SHUTDOWN_TIMEOUT_S, stopped_s
        assert "dapo learner: stopped by signal 15" in log  # torchrun_main's exit 143
        assert "forcefully exiting" not in log  # torchrun never had to SIGKILL a rank
        # The stop's checkpoint holds every step committed by then, from both ranks.
        tag = tmp_path / "run" / "checkpoints" / f"step{at_stop}"
        shards = sorted(p.name for p in tag.glob("*optim_states.pt"))
        assert len(shards) == 2 and any("rank_1" in s for s in shards), shards
        # It was written within the budget the learner computed from its shutdown timeout.
        stop_write = re.search(
            r"stop checkpoint step(\d+) written in ([\d.]+)s \(budget ([\d.]+)s", log
        )
        assert stop_write is not None, log[-3000:]
        assert int(stop_write[1]) == at_stop
        assert float(stop_write[2]) <= float(stop_write[3]) <= SHUTDOWN_TIMEOUT_S
        assert f"resumed step={at_stop}" in log
        assert "restarted learner" in out
        check_finished_exactly(client, run)


def test_a_killed_rank_restarts_the_group_which_resumes(
    tmp_path: Path, tiny_model: Path, killed_tree_env: dict[str, str]
) -> None:
    def kill_rank_1(torchrun: psutil.Process, client: redis.Redis, keys: RunKeys) -> None:
        config = next(arg for arg in torchrun.cmdline() if arg.endswith("config.yaml"))
        latest = Path(config).parent / "checkpoints" / "latest"
        wait_for(latest.is_file, 120, "a whole checkpoint")  # (the next may be in flight)
        rank(torchrun, 1).kill()

    with RedisServer(appendonly=True) as server:
        async_write = {"learner.checkpoint.async_write": "true"}  # both ranks in the background
        out, code, log, _, client, run = run_with_fault(
            server, tmp_path, tiny_model, killed_tree_env, 2, kill_rank_1, **async_write
        )
        assert code == 0, out[-3000:]
        assert "exitcode: -9" in log and "resumed step=" in log
        assert "restarted learner" not in out  # torchrun restarted the group, not dapo up
        check_finished_exactly(client, run)
