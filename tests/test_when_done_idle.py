"""`shared.when_done: idle` (set by the Kubernetes manifests): a service whose run is done
releases its work and keeps answering its probes until SIGTERM, instead of exiting 0 and
being restarted by its Deployment or StatefulSet. Started as `dapo buffer` is on a pod."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import redis

from services.common.keys import RunKeys
from services.common.redis_server import RedisServer

RUN = "idle-test"


def start_buffer(redis_url: str, *overrides: str) -> tuple[subprocess.Popen[bytes], str]:
    command = [
        sys.executable,
        "-c",
        "from services.tools.cli import main; raise SystemExit(main())",
        "buffer",
        "--redis-url",
        redis_url,
        "--http-port",
        "0",
        "--set",
        f"shared.run_name={RUN}",
        *overrides,
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    line = proc.stdout.readline().decode()  # type: ignore[union-attr]
    assert line.startswith("dapo buffer ready"), (line, proc.stderr.read() if proc.stderr else "")  # type: ignore[union-attr]
    ports = dict(field.split("=") for field in line.split()[3:])
    return proc, f"http://127.0.0.1:{ports['http']}"


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def test_idle_service_answers_probes_after_the_run_until_sigterm(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    redis_client.delete(RunKeys(RUN).done)
    proc, url = start_buffer(redis_server.url, "--set", "shared.when_done=idle")
    try:
        assert httpx.get(f"{url}/readyz", timeout=5).status_code == 200
        redis_client.set(RunKeys(RUN).done, 1)
        deadline = time.monotonic() + 20
        status: dict[str, object] = {}
        while time.monotonic() < deadline and status.get("run") != "done":
            try:
                status = httpx.get(f"{url}/status", timeout=2).json()
            except httpx.TransportError:  # between the role's server and the idle one
                pass
            time.sleep(0.2)
        assert status.get("run") == "done", status
        time.sleep(1)
        assert proc.poll() is None, "an idle service must not exit"
        assert httpx.get(f"{url}/readyz", timeout=5).status_code == 200
        assert httpx.get(f"{url}/healthz", timeout=5).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        stop(proc)
        redis_client.delete(RunKeys(RUN).done)


def test_by_default_a_finished_service_exits_0(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    """compose and `dapo up` keep their behaviour: `restart: on-failure` leaves it down."""
    redis_client.set(RunKeys(RUN).done, 1)
    proc, _ = start_buffer(redis_server.url)
    try:
        assert proc.wait(timeout=20) == 0
    finally:
        stop(proc)
        redis_client.delete(RunKeys(RUN).done)
