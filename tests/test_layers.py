"""The layer check itself: what counts as starting a role, and that the audit hook sees a
process started from any thread."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
from layers import ProcessWatch, layer_of, misplaced, starts_a_role


@pytest.mark.parametrize(
    "argv",
    [
        [sys.executable, "-m", "services.tools.cli", "up", "--preset", "tiny"],
        [sys.executable, "-m", "learner", "--preset", "tiny"],
        [sys.executable, "-m", "services.buffer"],
        [sys.executable, "-c", "from services.tools.cli import main; main()"],
        ["/venv/bin/dapo", "up"],
        ["torchrun", "--standalone", "--nproc-per-node", "2", "-m", "learner"],
        ["docker", "compose", "up"],
    ],
)
def test_a_role_started_as_users_do_is_seen(argv: list[str]) -> None:
    assert starts_a_role(argv)


@pytest.mark.parametrize(
    "argv",
    [
        ["/usr/bin/redis-server", "--port", "6390"],
        [sys.executable, "-c", "pass"],
        [sys.executable, "tests/learner_fixtures.py", "train", "model"],
        [sys.executable, "-m", "rollout_helpers"],
    ],
)
def test_other_processes_are_not_roles(argv: list[str]) -> None:
    assert not starts_a_role(argv)


def test_each_layer_refuses_what_belongs_to_the_next() -> None:
    redis_ = [["redis-server", "--port", "0"]]
    role = [[sys.executable, "-m", "reward"]]
    assert misplaced("unit", []) is None
    assert "unit test started a process" in (misplaced("unit", redis_) or "")
    assert misplaced("integration", redis_) is None
    assert "role" in (misplaced("integration", role) or "")
    assert misplaced("system", role) is None
    assert "SYSTEM_MODULES" in (misplaced("unit", role) or "")  # not "integration"
    assert (layer_of("test_algorithm.py"), layer_of("test_pipeline.py")) == ("unit", "system")
    assert layer_of("test_new_module.py") == "integration"


def test_the_watch_sees_processes_started_by_any_thread() -> None:
    watch = ProcessWatch()
    watch.start()
    subprocess.run([sys.executable, "-c", "pass"], check=True, timeout=60)
    worker = threading.Thread(target=subprocess.run, args=([sys.executable, "-c", "0"],))
    worker.start()
    worker.join(timeout=120)
    started = watch.stop()
    assert started[0] == [sys.executable, "-c", "pass"]
    assert started[1] == [sys.executable, "-c", "0"]
    assert watch.stop() == []
