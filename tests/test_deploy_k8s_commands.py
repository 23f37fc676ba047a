"""The commands the Kubernetes manifests carry, run for real on this machine: Redis' start
script (password from the mounted file via stdin, never argv or the environment) and its
probe, the init containers that hold a pod until the model or the prompts are on the
shared volume; and what the RDMA and Redis TLS components change."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml
from deploy_tools import DEPLOY, ROOT, by_key
from test_deploy_k8s import (
    K8S,
    SECRET_MOUNT,
    container_of,
    dapo_env,
    learner_parts,
    render,
    template_of,
)

from services.common.net import free_port
from services.common.redis_server import find_redis_server

PASSWORD = "0123abcd" * 6  # what `openssl rand -hex 24` gives


def redis_script(tmp_path: Path, port: int) -> tuple[list[str], dict[str, str]]:
    """The Redis container's command and environment, its paths moved under tmp_path."""
    container = container_of(render("base"), "redis")
    secrets, data = tmp_path / "secrets", tmp_path / "data"
    secrets.mkdir()
    data.mkdir()
    (secrets / "redis-password").write_text(PASSWORD + "\n")
    script = container["args"][0].replace(SECRET_MOUNT, str(secrets))
    script = script.replace("--dir /data", f"--dir {data}")
    assert "--port 6379" in script
    script = script.replace("--port 6379", f"--port {port} --bind 127.0.0.1")
    bin_dir = str(Path(find_redis_server()).parent)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "REDIS_TLS": "false"}
    return [*container["command"], script], env


def wait_for_redis(client: redis.Redis, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""  # type: ignore[union-attr]
        try:
            client.ping()
            return
        except redis.ConnectionError:
            time.sleep(0.1)
        except redis.AuthenticationError:
            return
    raise AssertionError("redis-server did not start")


def test_redis_starts_with_the_password_from_the_file_and_nowhere_else(tmp_path: Path) -> None:
    port = free_port()
    command, env = redis_script(tmp_path, port)
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_for_redis(redis.Redis(port=port, password=PASSWORD), proc)
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port).ping()
        client = redis.Redis(port=port, password=PASSWORD)
        assert client.ping() and client.config_get("appendonly") == {"appendonly": "yes"}
        assert client.config_get("dir")["dir"] == str(tmp_path / "data")
        pid = client.info("server")["process_id"]
        assert pid == proc.pid  # exec: redis-server is the container's process
        for what in ("cmdline", "environ"):
            assert PASSWORD.encode() not in Path(f"/proc/{pid}/{what}").read_bytes(), what
        probe = container_of(render("base"), "redis")["readinessProbe"]["exec"]["command"]
        probe_script = probe[-1].replace(SECRET_MOUNT, str(tmp_path / "secrets"))
        probe_script = probe_script.replace("redis-cli", f"redis-cli -p {port}")
        done = subprocess.run([*probe[:-1], probe_script], env=env, timeout=10)
        assert done.returncode == 0, "the readiness probe fails on a healthy Redis"
        (tmp_path / "secrets" / "redis-password").write_text("wrong\n")
        done = subprocess.run([*probe[:-1], probe_script], env=env, timeout=10)
        assert done.returncode != 0, "the probe passes with a wrong password"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def init_command(objects: list[dict[str, Any]], role: str, run_yaml: Path) -> list[str]:
    (init,) = template_of(objects, role)["spec"]["initContainers"]
    return [
        sys.executable if w == "python3" else w.replace("/etc/dapo/run.yaml", str(run_yaml))
        for w in init["command"]
    ]


@pytest.mark.parametrize(
    ("role", "needed"), [("learner", ["model"]), ("controller", ["data", "model"])]
)
def test_a_pod_waits_until_its_files_are_on_the_shared_volume(
    role: str, needed: list[str], tmp_path: Path
) -> None:
    """Applied before the copy (docs/deploy.md, step 4), a pod waits in its init container
    instead of starting, failing and using up the learner's restarts. The controller
    needs the model too: its tokenizer renders the prompts."""
    model, data = tmp_path / "models" / "policy", tmp_path / "data" / "prompts.parquet"
    run_yaml = tmp_path / "run.yaml"
    run_yaml.write_text(
        f"shared:\n  model_path: {model}\ncontroller:\n  dataset:\n"
        f"    kind: parquet\n    path: {data}\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        init_command(render("base"), role, run_yaml),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        for what in needed:
            target = model / "config.json" if what == "model" else data
            line = proc.stdout.readline().decode()  # type: ignore[union-attr]
            assert line == f"waiting for {target}\n", (line, proc.stderr.read())  # type: ignore[union-attr]
            assert proc.poll() is None
            target.parent.mkdir(parents=True)
            target.write_text("{}")
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_rdma_overlay_gives_the_learner_the_fabric() -> None:
    objects = render("multi-node-rdma")
    _, _, job, env = learner_parts(objects)
    container = job["template"]["spec"]["containers"][0]
    # No IPC_LOCK: nothing for uid 10001, and it breaks Pod Security (the runtime's memlock).
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    rdma = [k for k in container["resources"]["requests"] if k.startswith("rdma/")]
    assert rdma and all(container["resources"]["limits"][k] == "1" for k in rdma)
    assert env["NCCL_IB_DISABLE"] == "0" and env["NCCL_IB_HCA"]
    assert env["NCCL_SOCKET_IFNAME"] == "eth0"  # bootstrap over the pod network
    plain = learner_parts(render("multi-node"))[3]
    assert not [k for k in plain if k.startswith("NCCL_IB_")]
    # The image has the verbs libraries NCCL's IB transport dlopens.
    gpu = (DEPLOY / "docker" / "Dockerfile.gpu").read_text()
    runtime = gpu[gpu.index("AS runtime") :]
    assert {"libibverbs1", "ibverbs-providers", "librdmacm1"} <= set(runtime.split())


def test_redis_tls_reaches_every_client_and_redis() -> None:
    """With components/redis-tls every service dials rediss:// and checks Redis' certificate
    against the CA mounted beside the password; Redis gets its certificate and key at the
    paths its start script names; the plain overlays keep redis:// and no CA."""
    objects = render("multi-node-rdma")
    assert by_key(objects)[("ConfigMap", "dapo-redis")]["data"]["tls"] == "true"
    for role in ("controller", "buffer", "reward", "rollout", "learner"):
        env = dapo_env(objects, role)
        assert env["DAPO_SHARED__REDIS_URL"].startswith("rediss://redis:6379/")
        ca = env["DAPO_SECURITY__REDIS__CA"]
        assert ca == f"{SECRET_MOUNT}/redis-ca.crt"
        spec = template_of(objects, role)["spec"]
        volume = next(v for v in spec["volumes"] if v["name"] == "secrets")
        files = {
            i["path"]: (s["secret"]["name"], i["key"])
            for s in volume["projected"]["sources"]
            for i in s["secret"]["items"]
        }
        assert files["redis-ca.crt"] == ("dapo-redis-tls", "ca.crt"), role
    redis_spec = template_of(objects, "redis")["spec"]
    script = redis_spec["containers"][0]["args"][0]
    volume = next(v for v in redis_spec["volumes"] if v["name"] == "secrets")
    mounted = {i["path"] for s in volume["projected"]["sources"] for i in s["secret"]["items"]}
    named = set(re.findall(r"\$s/([\w.-]+)", script))
    assert named <= mounted and {"redis-tls.crt", "redis-tls.key", "redis-ca.crt"} <= named
    assert "--port 0" in script and "--tls-port 6379" in script  # TLS only
    plain = dapo_env(render("multi-node"), "rollout")
    assert (
        plain["DAPO_SHARED__REDIS_URL"].startswith("redis://")
        and "DAPO_SECURITY__REDIS__CA" not in plain
    )


def test_the_fill_volume_pod_mounts_the_shared_claim() -> None:
    (pod,) = [d for d in yaml.safe_load_all((K8S / "fill-volume.yaml").read_text()) if d]
    claims = {v["persistentVolumeClaim"]["claimName"] for v in pod["spec"]["volumes"]}
    storage = by_key(render("base"))[("PersistentVolumeClaim", "dapo-shared")]
    assert claims == {storage["metadata"]["name"]}
    assert pod["spec"]["securityContext"]["runAsUser"] == 10001  # the dapo pods' uid
