"""`dapo up`: Redis and the five services as real OS processes, end to end."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import redis
import yaml
from dapo_cli import run, set_args
from run_audit import children_of, role_process, wait_for

from services.common.adapters import decode_group
from services.common.keys import RunKeys
from services.common.redis_server import RedisServer
from services.common.settings import SharedConfig
from services.tools.cli import up_argv

pytestmark = pytest.mark.slow
RETAIN = 4  # acked entries kept at the tail of each stream


def dapo_up(run_dir: Path, model: Path, *extra: str, timeout: float = 240):
    return run([*up_argv(run_dir, model), *extra], timeout)


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_data_flows_through_every_service(
    tmp_path: Path, tiny_model: Path, redis_server: RedisServer, max_staleness: int
) -> None:
    run_dir = tmp_path / "run"
    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    result = dapo_up(
        run_dir,
        tiny_model,
        "--steps",
        "3",
        "--redis-url",
        redis_server.url,
        "--set",
        "shared.run_name=pipeline",
        "--set",
        f"shared.max_staleness={max_staleness}",
        "--set",
        "controller.eval.enabled=false",
        "--set",
        f"buffer.stream_retain={RETAIN}",
        "--set",
        "learner.generation_budget=null",
    )  # full batches
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads((run_dir / "report.json").read_text())
    ledger = report["ledger"]
    assert ledger["ok"], ledger["problems"]
    assert ledger["version"] == 3 and [s["step"] for s in report["steps"]] == [1, 2, 3]
    assert ledger["trained"] == 3 * 16  # train_batch_groups of the tiny preset
    # The staleness of every trained group respects the hard bound, and the step's policy
    # lag (per token, from the samples' versions) agrees.
    hard = SharedConfig(max_staleness=max_staleness).staleness_hard_bound
    assert all(0 <= s["staleness"] <= hard for s in report["steps"])
    assert all(s["policy_lag_max"] == s["staleness"] for s in report["steps"])

    keys = RunKeys("pipeline")
    # Acked entries are trimmed: the streams hold the retained tail plus what is pending.
    assert ledger["scored"] > RETAIN and ledger["kept"] > RETAIN
    assert client.xlen(keys.scored) <= RETAIN + ledger["pending_scored"]
    assert client.xlen(keys.train) <= RETAIN + ledger["pending_train"]
    forwarded = [decode_group(f[b"group"]) for _, f in client.xrange(keys.train)]
    assert forwarded and all(0 < g.accuracy < 1 for g in forwarded)
    # New weights reached the rollout server: later groups were sampled by version >= 1.
    versions = {s.policy_version for g in forwarded for s in g.samples}
    assert max(versions) >= 1
    assert not children_of(run_dir)


def test_launcher_stops_its_own_redis_and_every_child(tmp_path: Path, tiny_model: Path) -> None:
    run_dir = tmp_path / "run"
    result = dapo_up(
        run_dir,
        tiny_model,
        "--steps",
        "2",
        "--set",
        "controller.eval.n=1",
        "--set",
        "controller.eval.limit=10",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads((run_dir / "report.json").read_text())
    assert report["eval_before"]["version"] == 0 and report["eval_after"]["version"] == 2
    for name in ("reward", "accuracy", "response_length", "entropy", "kept_ratio"):
        assert (run_dir / "plots" / f"{name}.png").stat().st_size > 1000
    assert "held-out avg@1" in result.stdout
    url = yaml.safe_load((run_dir / "config.yaml").read_text())["shared"]["redis_url"]
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(url, socket_connect_timeout=1).ping()
    assert not children_of(run_dir)
    for role in ("controller", "rollout", "reward", "buffer", "learner"):
        assert "ready" in (run_dir / "logs" / f"{role}.log").read_text()


def test_run_survives_a_killed_rollout_server_and_reward_service(
    tmp_path: Path, tiny_model: Path, killed_tree_env: dict[str, str]
) -> None:
    run_dir = tmp_path / "run"
    sets = ["controller.eval.enabled=false", "learner.linger_s=0"]
    proc = subprocess.Popen(
        [*up_argv(run_dir, tiny_model), "--steps", "6", "--rollouts", "2", *set_args(sets)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=killed_tree_env,
    )
    try:
        learner_log = run_dir / "logs" / "learner.log"
        wait_for(
            lambda: learner_log.exists() and "step=2 " in learner_log.read_text(), 180, "step 2"
        )
        role_process(run_dir, "rollout").kill()
        role_process(run_dir, "reward").kill()
        out, _ = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-3000:]
    assert "restarted reward" in out and "restarted rollout-" in out
    report = json.loads((run_dir / "report.json").read_text())
    assert report["ledger"]["ok"] and report["ledger"]["version"] == 6
    assert not children_of(run_dir)


def test_killing_the_launcher_leaves_no_orphans(
    tmp_path: Path, tiny_model: Path, killed_tree_env: dict[str, str]
) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [*up_argv(run_dir, tiny_model), "--steps", "50", "--set", "controller.eval.enabled=false"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=killed_tree_env,
    )
    learner_log = run_dir / "logs" / "learner.log"
    wait_for(
        lambda: learner_log.exists() and "ready" in learner_log.read_text(),
        120,
        "the learner to start",
    )
    url = yaml.safe_load((run_dir / "config.yaml").read_text())["shared"]["redis_url"]
    proc.kill()  # SIGKILL: the launcher runs no clean-up at all
    proc.wait()
    wait_for(lambda: not children_of(run_dir), 30, "every service to exit")
    wait_for(lambda: not reachable(url), 10, "the launcher's redis-server to exit")


def reachable(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=1).ping())
    except redis.ConnectionError:
        return False
