"""The verifier pool's bookkeeping: tasks and outcomes, the jobs that carry them, the
workers that hold them, and how big a chunk a free worker gets (reward/pool.py)."""

from __future__ import annotations

import math
import os
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from reward.verifiers import Verdict
from reward.worker import MAX_CHUNK_ITEMS as _INDEX_LIMIT
from reward.worker import Progress, encode_task

MAX_DEATHS = 2  # a job that kills this many workers is answered with an error
CHUNK_SPREAD = 2  # a chunk is at most 1/(CHUNK_SPREAD x workers) of the queue
MAX_CHUNK_ITEMS = min(64, _INDEX_LIMIT)
MAX_CHUNK_BYTES = 256 * 1024  # a bigger single item still goes, alone


@dataclass(frozen=True)
class Outcome:
    """A verdict plus how long the worker spent on it and whether it was killed."""

    verdict: Verdict
    seconds: float
    timed_out: bool = False


@dataclass(frozen=True)
class Task:
    """One verification to run: which verifier, on what."""

    verifier: str
    response: str
    ground_truth: str


@dataclass
class Job:
    task: Task
    payload: bytes  # the task as a chunk element, encoded once
    future: Future[Outcome] = field(default_factory=Future)
    deaths: int = 0  # workers that died while verifying this job


def job_for(task: Task) -> Job:
    return Job(task, encode_task(task.verifier, task.response, task.ground_truth))


@dataclass
class Worker:
    """One process and the chunk it holds: `jobs` are its items not yet answered."""

    process: Any  # a multiprocessing Process of the pool's context
    conn: Connection
    progress: Progress
    ready: bool = False
    jobs: deque[Job] = field(default_factory=deque)
    answered: int = 0  # items of the current chunk already answered
    sent_at: float = 0.0  # when the current chunk was sent
    heard_at: float = 0.0  # when its last results (or the chunk itself) arrived

    def current(self) -> tuple[int, float]:
        """(position in `jobs`, start time) of the item the worker is verifying now.

        A mark older than the chunk is the previous chunk's; a mark of an answered item
        means the next one is about to start: both count from when we last heard."""
        index, started = self.progress.read()
        if started < self.sent_at or index < self.answered:
            return 0, self.heard_at
        return index - self.answered, started


def default_num_workers() -> int:
    """The CPUs this process may run on (cgroup/affinity aware where the OS says)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def chunk_size(queued: int, num_workers: int) -> int:
    """Guided self-scheduling: big chunks while the queue is long, single items at its end."""
    return max(1, min(MAX_CHUNK_ITEMS, math.ceil(queued / (CHUNK_SPREAD * num_workers))))


def failed(task: Task, error: str, seconds: float = 0.0, timed_out: bool = False) -> Outcome:
    """The wrong-answer outcome that stands in for a failed verification."""
    return Outcome(Verdict(False, "", task.verifier, error), seconds, timed_out)


def fail_all(jobs: Iterable[Job], error: str) -> None:
    for job in jobs:
        if not job.future.done():
            job.future.set_result(failed(job.task, error))
