"""What the system tests read off a running or finished `dapo up`: its processes (by the
run's config path on their command lines) and the trained-once audit of its Redis."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import psutil
import redis

from services.common.keys import RunKeys
from services.common.ledger import Ledger, read_ledger


def children_of(run_dir: Path) -> list[psutil.Process]:
    """Processes still running with this run's config (there must be none)."""
    marker = str(run_dir / "config.yaml")
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if marker in " ".join(proc.info["cmdline"] or []):
            found.append(proc)
    return found


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def role_process(run_dir: Path, role: str) -> psutil.Process:
    return next(p for p in children_of(run_dir) if p.info["cmdline"][3] == role)


def effective_steps(client: redis.Redis, keys: RunKeys) -> dict[int, list[str]]:
    """Group ids per step as in the final model: a step redone after a restart replaces
    the record of the lost one."""
    steps: dict[int, list[str]] = {}
    for _, fields in client.xrange(keys.steps):
        record = json.loads(fields[b"json"])
        steps[record["step"]] = record["groups"]
    return steps


def assert_trained_once(
    client: redis.Redis, run: str, steps: int, batch_groups: int
) -> tuple[Ledger, set[str]]:
    """The ledger holds, steps 1 to `steps` are in the final model once each, and each of
    their `batch_groups` groups was trained once; the ledger and the trained group ids."""
    ledger = read_ledger(client, run)
    assert not ledger.problems(), ledger.problems()
    final = effective_steps(client, RunKeys(run))
    assert sorted(final) == list(range(1, steps + 1))
    trained = Counter(g for groups in final.values() for g in groups)
    assert max(trained.values()) == 1  # no group trained twice
    assert sum(trained.values()) == steps * batch_groups
    return ledger, set(trained)
