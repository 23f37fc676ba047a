"""`dapo up` with every control on: mTLS between services, a token, a Redis password."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import grpc
import httpx
import pytest
import yaml
from pki import Issued, make_node_cert

from dapo.v1 import rollout_pb2, rollout_pb2_grpc
from services.common.grpc_server import channel, insecure_channel
from services.common.keys import RunKeys
from services.common.redis_server import connect
from services.common.registry import discover
from services.common.security import AuthConfig, RedisAuthConfig, SecurityConfig, TlsConfig
from services.tools.cli import up_argv

pytestmark = pytest.mark.slow

TOKEN = "launcher-test-token-5f1c"
REDIS_PASSWORD = "launcher-redis-pw-9a2e"


def rollout_entry(run_dir: Path) -> dict:
    """The first rollout server's registry entry, read with the run's Redis password."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if (run_dir / "config.yaml").is_file():
            url = yaml.safe_load((run_dir / "config.yaml").read_text())["shared"]["redis_url"]
            client = connect(url, RedisAuthConfig(password=REDIS_PASSWORD))
            found = discover(client, RunKeys("tiny"), "rollout")
            if found:
                return found[0]
        time.sleep(0.1)
    raise AssertionError("no rollout server registered")


def probe_rollout(run_dir: Path, ca: Path, node: Issued) -> None:
    """While the run goes: the rollout server wants mTLS for gRPC and the token everywhere."""
    entry = rollout_entry(run_dir)
    tls = TlsConfig(enabled=True, mtls=True, ca=str(ca), cert=str(node.cert), key=str(node.key))
    request = rollout_pb2.GetStatusRequest()
    with insecure_channel(entry["address"]) as plain:
        with pytest.raises(grpc.RpcError) as err:
            rollout_pb2_grpc.RolloutServiceStub(plain).GetStatus(request, timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    with channel(entry["address"], SecurityConfig(tls=tls)) as no_token:
        with pytest.raises(grpc.RpcError) as err:
            rollout_pb2_grpc.RolloutServiceStub(no_token).GetStatus(request, timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    full = SecurityConfig(tls=tls, auth=AuthConfig(token=TOKEN))
    with channel(entry["address"], full) as chan:
        assert rollout_pb2_grpc.RolloutServiceStub(chan).GetStatus(request, timeout=10).engine
    url = f"http://{entry['http']}"
    assert httpx.get(f"{url}/metrics").status_code == 401
    assert httpx.get(f"{url}/healthz").status_code == 200
    status = httpx.get(f"{url}/status", headers={"Authorization": f"Bearer {TOKEN}"})
    assert status.status_code == 200


def test_dapo_up_runs_with_mtls_token_and_redis_password(tmp_path: Path, tiny_model: Path) -> None:
    (tmp_path / "pki").mkdir()
    ca, node = make_node_cert(tmp_path / "pki")
    config = {
        "security": {
            "tls": {
                "enabled": True,
                "mtls": True,
                "ca": str(ca),
                "cert": str(node.cert),
                "key": str(node.key),
            },
            "auth": {"token": TOKEN, "scope": "all", "protect_metrics": True},
            "redis": {"password": REDIS_PASSWORD},
        },
    }
    config_path = tmp_path / "secured.yaml"
    config_path.write_text(yaml.safe_dump(config))
    run_dir = tmp_path / "run"
    options = ["--config", str(config_path), "--steps", "3"]
    proc = subprocess.Popen(
        [*up_argv(run_dir, tiny_model), *options, "--set", "controller.eval.enabled=false"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        probe_rollout(run_dir, ca, node)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, stderr[-2000:]
    report = json.loads((run_dir / "report.json").read_text())
    # Every hop worked: controller -> rollout/reward, rollout -> learner (FetchWeights:
    # with max_staleness 1, step 3 needs groups sampled by pulled weights of version >= 1).
    assert report["ledger"]["ok"] and report["ledger"]["version"] == 3
    written = (run_dir / "config.yaml").read_text()
    assert yaml.safe_load(written)["security"]["tls"]["mtls"] is True
    logs = "".join(p.read_text(errors="replace") for p in (run_dir / "logs").glob("*.log"))
    # Weights moved over the weight socket, under the same mTLS, with no fallback while
    # the run trained (once it is done the learner stops, and a rollout server still
    # pulling the last version may find it gone: that is shutdown, not a fallback).
    assert "over the weight socket" in logs
    training = until_done(run_dir / "logs" / "rollout.log", run_dir / "logs" / "learner.log")
    assert "unreachable" not in training, training[-2000:]
    for secret in (TOKEN, REDIS_PASSWORD):  # never written to the run's files or logs
        assert secret not in written and secret not in logs
        assert secret not in stdout + stderr


def until_done(log: Path, learner_log: Path) -> str:
    """`log` up to the second the learner logged the run done (lines start HH:MM:SS)."""
    done = re.search(r"^(\d\d:\d\d:\d\d) .*run done", learner_log.read_text(), re.M)
    assert done, "the learner logged no `run done`"
    kept = []
    for line in log.read_text(errors="replace").splitlines():
        stamp = re.match(r"\d\d:\d\d:\d\d", line)
        if stamp and stamp.group(0) > done.group(1):
            break
        kept.append(line)
    return "\n".join(kept)
