"""A run directory (`runs/NAME`) and what `dapo up` keeps in it beside logs and report:
the lock that makes it one run's at a time, `run.json` (the run's id and segments), the
Redis data the run's own redis-server appends to, and the learner's checkpoints. `dapo
ledger --run` and `dapo eval --run` read a run from here; docs/runs.md.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from services.common.errors import DapoError
from services.tools.config import DapoConfig, load_config

LOCK_FILE = ".lock"
REDIS_DIR = "redis"  # the run's own redis-server's --dir (its append-only file)


class RunLock:
    """An exclusive lock on a run directory for one `dapo up` (released when it exits,
    however it exits: the kernel drops a dead process's flock)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / LOCK_FILE
        self._file: IO[str] | None = None

    def acquire(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = self.path.open("a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "?"
            f.close()
            raise DapoError(
                f"{self.path.parent} is in use by another `dapo up` (pid {holder}); wait for "
                f"it or stop it, or pass another --run-dir or shared.run_name"
            ) from None
        f.truncate(0)
        f.write(str(os.getpid()))
        f.flush()
        self._file = f
        return self

    def release(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def run_is_live(run_dir: Path) -> bool:
    """Whether a `dapo up` holds the run directory now."""
    path = run_dir / LOCK_FILE
    if not path.is_file():
        return False
    with path.open() as f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
    return False


def fresh_redis_dir(run_dir: Path) -> Path:
    """The run's Redis data directory, emptied: a new run never inherits an old state."""
    path = run_dir / REDIS_DIR
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def latest_checkpoint_step(config: DapoConfig) -> int | None:
    """The step of the learner's latest checkpoint (`<checkpoint.dir>/latest` = `stepN`)."""
    directory = config.learner.checkpoint.dir
    latest = Path(directory) / "latest" if directory else None
    if latest is None or not latest.is_file():
        return None
    tag = latest.read_text().strip()
    return int(tag.removeprefix("step")) if tag.removeprefix("step").isdigit() else None


def load_run(run_dir: Path) -> DapoConfig:
    """The resolved config the run's `dapo up` wrote.

    A run directory moved aside (`dapo up --fresh`) or copied keeps its checkpoints
    inside it, while its config still names `<where it ran>/checkpoints` (the default
    the launcher filled in), which may now be another run's: that default is read as the
    directory's own `checkpoints`."""
    path = run_dir / "config.yaml"
    if not path.is_file():
        raise DapoError(f"{run_dir} is not a run directory (no config.yaml)")
    config = load_config(path, env={})
    recorded, own = config.learner.checkpoint.dir, run_dir / "checkpoints"
    if recorded is not None and Path(recorded).name == own.name and own.is_dir():
        config.learner.checkpoint.dir = str(own)
    return config


@contextmanager
def run_redis(run_dir: Path) -> Iterator[DapoConfig]:
    """The run's config with a `redis_url` that answers: the live run's Redis, an external
    one the run used, or its own redis-server started again from the run directory's
    append-only file (stopped on exit; the file stays)."""
    config = load_run(run_dir)
    data = run_dir / REDIS_DIR
    if run_is_live(run_dir) or not data.is_dir():
        yield config
        return
    if not any(data.iterdir()):
        raise DapoError(
            f"{data} holds no append-only file (the run had shared.redis_appendonly: false): "
            "its state went with its Redis"
        )
    from services.common.redis_server import start_redis

    server = start_redis(appendonly=True, password=config.security.redis.secret(), data_dir=data)
    try:
        yield with_redis_url(config, server.url)
    finally:
        server.stop()


def with_redis_url(config: DapoConfig, url: str) -> DapoConfig:
    updates: dict[str, Any] = {"redis_url": url}
    return config.model_copy(update={"shared": config.shared.model_copy(update=updates)})


# ---------------------------------------------------------------- the run's identity
RUN_FILE = "run.json"  # the run's id and its segments (one per `dapo up`)


@dataclass
class RunRecord:
    """Who the run in a directory is: its id (minted at its first start, stamped in its
    Redis, checkpoints and report) and each `dapo up` segment that ran it."""

    run_id: str
    run_name: str
    segments: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "run_name": self.run_name, "segments": self.segments}


def mint_run_id() -> str:
    return uuid.uuid4().hex[:12]


def read_record(run_dir: Path) -> RunRecord | None:
    path = run_dir / RUN_FILE
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    return RunRecord(str(data["run_id"]), str(data["run_name"]), list(data.get("segments", [])))


def write_record(run_dir: Path, record: RunRecord) -> None:
    tmp = run_dir / f"{RUN_FILE}.tmp"
    tmp.write_text(json.dumps(record.as_dict(), indent=2))
    tmp.replace(run_dir / RUN_FILE)


# What a directory holds once a `dapo up` ran in it (an older one wrote no run.json).
RUN_MARKS = (RUN_FILE, "report.json", "checkpoints")


def holds_run(run_dir: Path) -> bool:
    return any((run_dir / mark).exists() for mark in RUN_MARKS)


def move_aside(run_dir: Path) -> Path:
    """Move everything of the run in `run_dir` (its lock excepted: we hold it) into a
    sibling `<run_dir>.old-<UTC stamp>`; nothing is deleted."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    aside = run_dir.with_name(f"{run_dir.name}.old-{stamp}")
    n = 1
    while aside.exists():
        aside, n = run_dir.with_name(f"{run_dir.name}.old-{stamp}-{n}"), n + 1
    aside.mkdir(parents=True)
    for entry in run_dir.iterdir():
        if entry.name != LOCK_FILE:
            entry.rename(aside / entry.name)
    return aside


def redis_dir(run_dir: Path, keep: bool) -> Path:
    """The run's Redis data directory: kept for a resumed run, else emptied."""
    if not keep:
        return fresh_redis_dir(run_dir)
    path = run_dir / REDIS_DIR
    path.mkdir(parents=True, exist_ok=True)
    return path
