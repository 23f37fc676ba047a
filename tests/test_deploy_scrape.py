"""Live: Debian's Prometheus scrapes a short `dapo up --preset tiny` run with the project's
scrape config and alert rules, and its HTTP API shows every target up, the key series with
values, every dashboard query evaluating, and every alert rule evaluating without error."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from dapo_cli import popen_as_typed, set_args
from deploy_tools import DEPLOY, ROOT, require_tool

from scripts.prometheus_checks import api, dashboard_queries
from services.common.net import free_port
from services.tools.cli import up_argv

pytestmark = pytest.mark.slow

ROLES = ("controller", "buffer", "reward", "learner", "rollout")
READY = re.compile(r"dapo (\w+) ready .*http=(\d+)")
# Series a healthy run must have within seconds: (PromQL, what it shows).
KEY_SERIES = [
    ("dapo_controller_groups_scored_total > 0", "the controller scored groups"),
    ("sum(dapo_buffer_groups_total) > 0", "the buffer decided groups"),
    ("sum(dapo_reward_items_total) > 0", "the reward service verified items"),
    ("dapo_rollout_tokens_generated_total > 0", "the rollout server generated tokens"),
    ("dapo_learner_policy_version >= 1", "the learner committed a step"),
    ("dapo_learner_entropy", "the learner exports its step metrics"),
]


LAUNCHER_GRACE_S = 150  # the launcher's own learner grace, 125 s by default, and margin


def wait_for(what: str, check: Callable[[], Any], timeout_s: float, poll_s: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}: {result}")
        time.sleep(poll_s)


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, grace_s: float = 30) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def tiny_run(tmp_path: Path, tiny_model: Path) -> Iterator[dict[str, int]]:
    """A `dapo up --preset tiny` that trains for longer than the test; role → HTTP port."""
    run_dir = tmp_path / "run"
    sets = ["shared.run_name=scrape", "controller.eval.enabled=false"]
    cmd = [*up_argv(run_dir, tiny_model), "--steps", "10000", *set_args(sets)]
    launcher = popen_as_typed(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    found: dict[str, int] = {}

    def ports() -> dict[str, int] | None:
        assert launcher.poll() is None, launcher.stderr.read().decode()[-2000:]  # type: ignore[union-attr]
        for role in set(ROLES) - set(found):
            log = run_dir / "logs" / f"{role}.log"
            match = READY.search(log.read_text()) if log.exists() else None
            if match:
                found[role] = int(match.group(2))
        return found if len(found) == len(ROLES) else None

    try:
        # Generous: on a loaded 2-core machine torch imports alone can take 20 s.
        yield wait_for("every service to print its ports", ports, timeout_s=150)
    finally:
        # the launcher stops every service and its Redis, giving the learner the grace
        # it may take to checkpoint (learner.launch.shutdown_timeout_s + 5)
        stop(launcher, signal.SIGINT, grace_s=LAUNCHER_GRACE_S)
    assert launcher.returncode in (0, 130), launcher.stderr.read().decode()[-2000:]  # type: ignore[union-attr]


def scrape_config(targets_dir: Path) -> dict[str, Any]:
    """deploy/prometheus/prometheus.yml, each job discovering its target from a file (the
    run's ports are known only once the services print them), scraping every second."""
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = [str(DEPLOY / "prometheus" / name) for name in config["rule_files"]]
    for job in config["scrape_configs"]:
        job.pop("dns_sd_configs", None)
        job.pop("static_configs", None)
        files = [str(targets_dir / f"{job['job_name']}.json")]
        job["file_sd_configs"] = [{"files": files, "refresh_interval": "1s"}]
    return config


def point_at(targets_dir: Path, ports: dict[str, int]) -> None:
    for job, port in ports.items():
        path = targets_dir / f"{job}.json"
        path.with_suffix(".tmp").write_text(json.dumps([{"targets": [f"127.0.0.1:{port}"]}]))
        path.with_suffix(".tmp").rename(path)


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """Debian's Prometheus on a free port; (its URL, the directory of its target files)."""
    binary = require_tool("prometheus", "prometheus")
    port = free_port()
    targets = tmp_path / "targets"
    targets.mkdir()
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump(scrape_config(targets)))
    point_at(targets, {"prometheus": port})
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]  # type: ignore[union-attr]
        try:
            return urllib.request.urlopen(f"{url}/-/ready", timeout=2).status == 200
        except OSError:
            return False

    try:
        wait_for("Prometheus to be ready", ready, timeout_s=30)
        yield url, targets
    finally:
        stop(proc)


def test_prometheus_scrapes_every_service_of_a_tiny_run(
    prometheus: tuple[str, Path], tiny_run: dict[str, int]
) -> None:
    prometheus, targets = prometheus  # type: ignore[assignment]
    point_at(targets, {f"dapo-{role}": port for role, port in tiny_run.items()})

    def targets_up() -> dict[str, str] | None:
        active = api(prometheus, "targets")["activeTargets"]
        health = {t["labels"]["job"]: t["health"] for t in active}
        return health if all(h == "up" for h in health.values()) and len(health) == 6 else None

    health = wait_for("every target to be up", targets_up, timeout_s=30)
    assert set(health) == {f"dapo-{role}" for role in ROLES} | {"prometheus"}

    for query, meaning in KEY_SERIES:
        result = wait_for(
            meaning, lambda q=query: api(prometheus, "query", query=q)["result"], timeout_s=40
        )
        assert float(result[0]["value"][1]) >= 0, (query, result)

    queries = dashboard_queries("15s")  # 1 s scrapes: 15 s holds enough samples for rate()
    with_data = 0
    for _, expr in queries:  # each must evaluate (a PromQL error raises)
        with_data += bool(api(prometheus, "query", query=expr)["result"])
    assert with_data >= len(queries) // 2

    def rules_evaluated() -> list[dict[str, Any]] | None:
        rules = [r for g in api(prometheus, "rules")["groups"] for r in g["rules"]]
        return rules if all(r.get("lastEvaluation", "").startswith("2") for r in rules) else None

    rules = wait_for("every alert rule to be evaluated", rules_evaluated, timeout_s=10)
    assert len(rules) >= 6
    assert all(r["health"] == "ok" for r in rules), [r for r in rules if r["health"] != "ok"]
    firing = {a["labels"]["alertname"] for a in api(prometheus, "alerts")["alerts"]}
    assert not firing & {"DapoRolloutServerDown", "DapoServiceDown"}
