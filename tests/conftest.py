"""Shared fixtures: a real redis-server on a free port, a tiny model built locally, and a
private temp directory for the session that must be empty again when the suite ends."""

from __future__ import annotations

import getpass
import multiprocessing.util
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from tmpdirs import tmpdir_at

from services.common.redis_server import RedisServer, start_redis

# The unit layer (`make test-fast`, `pytest -m unit`): modules of in-process checks that start
# no subprocess, server or Redis and build no model on disk; together well under a minute on
# 2 cores. A module joins by name here (test_architecture checks that each exists and stays
# free of servers); the rest of the suite is the integration and system layer.
UNIT_MODULES = frozenset(
    {
        "test_ablation_results.py",
        "test_algorithm.py",
        "test_batching.py",
        "test_bench_results.py",
        "test_buffer_filters.py",
        "test_config.py",
        "test_correction.py",
        "test_deploy_autoscaling.py",
        "test_deploy_grafana.py",
        "test_deploy_stack_checks.py",
        "test_docs_reward.py",
        "test_engine_base.py",
        "test_no_unsafe_deserialization.py",
        "test_packing.py",
        "test_recycled.py",
        "test_report.py",
        "test_reward_shaping.py",
        "test_reward_verifiers.py",
        "test_staleness.py",
    }
)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Under exactly `-m unit` import only the unit modules: importing the rest to deselect
    them would cost ~10 s of a fast run."""
    is_test_module = collection_path.name.startswith("test_") and collection_path.suffix == ".py"
    if config.getoption("markexpr") == "unit" and is_test_module:
        return collection_path.name not in UNIT_MODULES
    return None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test of a UNIT_MODULES module `unit`."""
    for item in items:
        if item.path.name in UNIT_MODULES:
            item.add_marker(pytest.mark.unit)


@pytest.fixture(scope="session", autouse=True)
def private_tmpdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Point TMPDIR (inherited by subprocesses) and `tempfile` at a directory of the
    session's own, and fail the session if anything is left in it at the end: a test that
    leaves files behind fills the machine's /tmp run after run. Other processes on the
    machine write to /tmp too, hence a private directory.

    What outlives a test by design stays where it was, resolved before the switch:
    pytest's own directories (`tmp_path`, kept for the last few runs), this process's
    multiprocessing directory (the reward pool's forkserver socket; removed at exit) and
    torch's compile cache (one per user, reused across runs).
    """
    tmp_path_factory.getbasetemp()
    multiprocessing.util.get_temp_dir()
    os.environ.setdefault(
        "TORCHINDUCTOR_CACHE_DIR",
        os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}"),
    )
    private = Path(tempfile.mkdtemp(prefix="dapo-tests-"))
    try:
        with tmpdir_at(private):
            yield private
            left = sorted(p.name for p in private.iterdir())
    finally:
        shutil.rmtree(private, ignore_errors=True)
    assert not left, f"the suite left {len(left)} entries in its temp dir: {left[:20]}"


@pytest.fixture
def killed_tree_env(tmp_path: Path) -> dict[str, str]:
    """The environment for a process tree the test kills (SIGKILL): a killed process
    cannot remove its temp files (redis-server's dir, the reward pool's forkserver
    socket dir), so its TMPDIR is inside tmp_path, which pytest cleans up."""
    tmp = tmp_path / "tmpdir"
    tmp.mkdir()
    return {**os.environ, "TMPDIR": str(tmp)}


@pytest.fixture
def killed_run_dir(
    tmp_path: Path, killed_tree_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> Path:
    """The run directory of a run launched in the test's process whose children it kills:
    TMPDIR, which the launcher's children inherit, is `killed_tree_env`'s."""
    monkeypatch.setenv("TMPDIR", killed_tree_env["TMPDIR"])
    return tmp_path / "run"


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = start_redis()
    yield server
    server.stop()


@pytest.fixture
def redis_client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    yield client
    client.close()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from learner.init_model import init_model

    return init_model(tmp_path_factory.mktemp("tiny-model"), preset="tiny", seed=0)
