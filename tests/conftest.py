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
from layers import ignore_collect, layer_breach, mark_layers, watch_test
from tmpdirs import tmpdir_at

from services.common.redis_server import RedisServer, start_redis


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    return ignore_collect(collection_path, config)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test with its layer (tests/layers.py)."""
    mark_layers(items)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    watch_test()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """After its teardown, a test that left its layer fails (tests/layers.py says why)."""
    outcome = yield
    if call.when != "teardown":
        return
    breach = layer_breach(item)
    report = outcome.get_result()
    if breach and report.passed:
        report.outcome = "failed"
        report.longrepr = breach


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
