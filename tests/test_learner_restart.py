"""A restarted learner process resumes from its checkpoint directory, by itself.

docker-compose (`restart: on-failure`) and Kubernetes restart the learner with the same
command: no `learner.checkpoint.resume=true`. Once the run's Redis holds a published version, the
checkpoint in learner.checkpoint.dir belongs to this run and is restored; the base model is never
published as a newer version (docs/deploy.md, "A run that ends, ends").

- a finished run, restarted: no new version, no new step, the trained weights served;
- SIGTERM mid-run (a node drain): the learner checkpoints and exits 143 (its Job
  replaces the pod, `restart: on-failure` restarts it); restarted, it
  resumes at that step and the run ends at version == total_steps.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import redis
import torch
from dapo_cli import DAPO, set_args
from learner_fixtures import TORCH_FP32_STEP, fill_train, learner_config
from safetensors.torch import load_file
from test_dead_rollout import fetch, listening_ports

from services.common.keys import RunKeys
from services.common.ledger import read_ledger
from services.common.redis_server import RedisServer
from services.common.registry import discover
from services.tools.config import dump_config

BATCH = 2


def _config_file(tmp_path: Path, model: Path, url: str, run: str, steps: int) -> Path:
    sets = {
        **TORCH_FP32_STEP,
        "shared.redis_url": url,
        "shared.train_batch_groups": BATCH,
        "learner.total_steps": steps,
        "learner.checkpoint.dir": str(tmp_path / "ckpt"),
        "learner.checkpoint.every": 100,
        "learner.linger_s": 0,
        "learner.server.grpc_port": 0,
        "learner.server.http_port": 0,
    }
    path = tmp_path / "run.yaml"
    path.write_text(dump_config(learner_config(model, run, sets)))
    return path


def _learner(config: Path, log: Path, *sets: str) -> subprocess.Popen:
    """`dapo learner` as compose and Kubernetes run it: no resume flag."""
    return subprocess.Popen(
        [*DAPO, "learner", "--config", str(config), *set_args(sets)],
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
    )


def _until(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if found := check():
            return found
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _registered(client: redis.Redis, keys: RunKeys, pid: int) -> dict | None:
    """This process's registry entry (not one an earlier learner left behind)."""
    ports = listening_ports(pid)
    entries = discover(client, keys, "learner")
    return next((e for e in entries if int(e["address"].rsplit(":", 1)[1]) in ports), None)


def _steps(client: redis.Redis, run: str) -> list[int]:
    import json

    return [json.loads(f[b"json"])["step"] for _, f in client.xrange(RunKeys(run).metrics)]


def test_a_finished_run_restarted_publishes_no_new_version(
    tmp_path: Path, tiny_model: Path, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    run, keys = "restart-done", RunKeys("restart-done")
    config = _config_file(tmp_path, tiny_model, redis_server.url, run, steps=2)
    fill_train(redis_client, run, BATCH * 2, seed=3)
    log = tmp_path / "learner.log"
    assert _learner(config, log).wait(timeout=180) == 0, log.read_text()[-3000:]
    assert int(redis_client.get(keys.version)) == 2 and redis_client.exists(keys.done)
    final = load_file(str(tmp_path / "ckpt" / "final" / "model.safetensors"))
    base = load_file(str(tiny_model / "model.safetensors"))

    again = _learner(config, log, "learner.linger_s=60")
    try:
        entry = _until(lambda: _registered(redis_client, keys, again.pid), 120, "registration")
        offered, version, served = fetch(entry["address"], timeout=30)
        again.send_signal(signal.SIGTERM)
        assert again.wait(timeout=60) == 0, log.read_text()[-3000:]
    finally:
        again.kill()
    assert offered == version == 2 == int(redis_client.get(keys.version))
    assert _steps(redis_client, run) == [1, 2]  # nothing trained or committed again
    shared = served.keys() & final.keys()
    assert len(shared) >= len(final) - 1  # tied embeddings may be saved once
    assert all(torch.equal(served[n], final[n]) for n in shared)  # the trained weights
    assert any(not torch.equal(served[n], base[n]) for n in shared)  # not the base model


def test_sigterm_checkpoints_and_a_restart_resumes(
    tmp_path: Path, tiny_model: Path, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    run, keys = "restart-drain", RunKeys("restart-drain")
    config = _config_file(tmp_path, tiny_model, redis_server.url, run, steps=4)
    fill_train(redis_client, run, BATCH * 2, seed=4)  # half the run: then it waits for more
    log = tmp_path / "learner.log"
    first = _learner(config, log)
    try:
        _until(lambda: int(redis_client.get(keys.version) or 0) == 2, 180, "two steps")
        first.send_signal(signal.SIGTERM)  # what a node drain does
        assert first.wait(timeout=60) == 143, log.read_text()[-3000:]  # unfinished: a failure
    finally:
        first.kill()
    assert (tmp_path / "ckpt" / "latest").read_text() == "step2"
    assert read_ledger(redis_client, run).trained == 2 * BATCH  # acked with the checkpoint

    fill_train(redis_client, run, BATCH * 2, seed=5)
    assert _learner(config, log).wait(timeout=180) == 0, log.read_text()[-3000:]
    assert int(redis_client.get(keys.version)) == 4  # resumed at 2: no base model as 3
    assert _steps(redis_client, run) == [1, 2, 3, 4]
    ledger = read_ledger(redis_client, run)
    assert ledger.trained == 4 * BATCH and redis_client.exists(keys.done)
