"""A pool of killable verifier processes with a hard per-item timeout.

Why processes and why killable: math-verify's own timeouts use SIGALRM, which only works
in a process's main thread, and inputs such as `9^{9^{9^{9^9}}}` keep the GIL inside
C code, so no thread can interrupt them. Each worker therefore runs one item at a time
in its main thread; a dispatcher thread in the server watches the deadlines and, when an
item runs past `timeout_s`, kills that one worker, answers the item with a timeout error
and starts a replacement. Other items, also of the same batch, carry on in the other
workers. A worker that dies on its own (crash, OOM killer) is replaced too; its item is
retried once elsewhere, since it may have died before reading it, and a second death
answers it with an error.

Each worker gets up to PIPELINE_DEPTH jobs ahead, so it starts the next item the moment
it finishes one instead of idling for a round trip through the dispatcher; the deadline
applies to the oldest job only, timed from when the one before it came back. Jobs queued
behind a killed job have not started and go back to the front of the queue.

Workers start from a forkserver that has already imported math-verify, so a replacement
is ready in milliseconds instead of a second of imports. Messages on the pipes are JSON
(no pickle on any queue); JSON also carries lone surrogates intact.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import signal
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from reward.verifiers import Verdict, run_verifier

log = logging.getLogger(__name__)

PRELOAD = ["reward.verifiers", "reward.preload"]
MAX_DEATHS = 2  # a job that kills this many workers is answered with an error
PIPELINE_DEPTH = 2  # jobs sent ahead to a worker, so it never waits for the dispatcher
# A job sent ahead sits in the pipe until the worker is free; above this size it could
# fill the pipe and block the dispatcher (and with it every deadline), so it waits.
PIPELINE_MAX_BYTES = 32 * 1024
STARTUP_FAILURES_BEFORE_GIVING_UP = 5


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
class _Job:
    task: Task
    future: Future[Outcome] = field(default_factory=Future)
    deaths: int = 0  # workers that died holding this job
    _payload: bytes | None = None

    @property
    def payload(self) -> bytes:
        """The JSON message for the worker, encoded once."""
        if self._payload is None:
            task = self.task
            message = {"verifier": task.verifier, "response": task.response}
            message["ground_truth"] = task.ground_truth
            self._payload = json.dumps(message).encode()
        return self._payload


@dataclass
class _Worker:
    """One process and the jobs sent to it, oldest (the one it is running) first."""

    process: Any  # a multiprocessing Process of the pool's context
    conn: Connection
    ready: bool = False
    jobs: deque[_Job] = field(default_factory=deque)
    started: float = 0.0  # when the oldest job started (≈ when the one before it returned)


def worker_main(conn: Connection, soft_timeout_s: int) -> None:
    """A worker's loop: read a task, verify it in this main thread, answer, repeat."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when workers stop
    from reward.preload import warm_up  # a no-op after the forkserver preload; else pay now

    warm_up()

    conn.send_bytes(json.dumps({"ready": os.getpid()}).encode())
    while True:
        try:
            msg = json.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        start = time.perf_counter()
        verdict = run_verifier(
            msg["verifier"], msg["response"], msg["ground_truth"], soft_timeout_s
        )
        reply = {**verdict.__dict__, "seconds": time.perf_counter() - start}
        conn.send_bytes(json.dumps(reply).encode())


def default_num_workers() -> int:
    """The CPUs this process may run on (cgroup/affinity aware where the OS says)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


class VerifierPool:
    """Runs `Task`s in worker processes; `submit` is thread-safe and never raises."""

    def __init__(
        self,
        num_workers: int | None = None,
        timeout_s: float = 5.0,
        soft_timeout_s: int = 2,
        start_method: str = "forkserver",
        on_restart: Callable[[str], None] | None = None,
    ) -> None:
        self.num_workers = num_workers or default_num_workers()
        self.timeout_s = timeout_s
        self.soft_timeout_s = soft_timeout_s
        self._ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            self._ctx.set_forkserver_preload(PRELOAD)
        self._on_restart = on_restart or (lambda reason: None)
        self._queue: deque[_Job] = deque()
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._workers: list[_Worker] = []
        self._closed = threading.Event()
        self._startup_failures = 0  # consecutive workers that died before becoming ready
        self._thread = threading.Thread(target=self._run, name="reward-pool", daemon=True)
        self.restarts = 0

    # -- public API ---------------------------------------------------------------

    def start(self) -> VerifierPool:
        """Start the dispatcher; it starts the workers (check `ready`)."""
        self._thread.start()
        return self

    @property
    def ready(self) -> bool:
        """All workers are up and have loaded math-verify."""
        workers = list(self._workers)
        return len(workers) == self.num_workers and all(w.ready for w in workers)

    def wait_ready(self, timeout_s: float = 60.0) -> bool:
        """Block until `ready` (for tests and benchmarks); False on timeout or close."""
        deadline = time.monotonic() + timeout_s
        while not self.ready:
            if self._closed.is_set() or time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def worker_pids(self) -> list[int]:
        """Current worker process ids (they change when a stuck worker is replaced)."""
        return [w.process.pid for w in list(self._workers)]

    def submit(self, task: Task) -> Future[Outcome]:
        """Queue one task; the future always gets an Outcome, never an exception."""
        return self.submit_many([task])[0]

    def submit_many(self, tasks: Sequence[Task]) -> list[Future[Outcome]]:
        """Queue a batch under one lock and one wake-up of the dispatcher (not one each)."""
        jobs = [_Job(task) for task in tasks]
        if self._closed.is_set():
            for job in jobs:
                job.future.set_result(_failed(job.task, "reward pool is shut down"))
            return [job.future for job in jobs]
        with self._lock:
            self._queue.extend(jobs)
        self._wake()
        return [job.future for job in jobs]

    def run_all(self, tasks: Sequence[Task]) -> list[Outcome]:
        """Submit every task, wait for all; results in input order."""
        return [f.result() for f in self.submit_many(tasks)]

    def close(self) -> None:
        """Stop the dispatcher and the workers; pending tasks get an error outcome."""
        self._closed.set()
        self._wake()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        for worker in list(self._workers):
            self._stop_worker(worker)
        self._workers.clear()
        with self._lock:
            pending, self._queue = list(self._queue), deque()
        for job in pending:
            job.future.set_result(_failed(job.task, "reward pool is shut down"))
        self._wake_r.close()
        self._wake_w.close()

    # -- dispatcher thread --------------------------------------------------------

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except OSError:  # closed, or the buffer is full: the dispatcher is awake anyway
            pass

    def _run(self) -> None:
        for _ in range(self.num_workers):
            self._workers.append(self._spawn())
        while not self._closed.is_set():
            try:
                self._step()
            except Exception:  # keep serving; a bug here must not hang every caller
                log.exception("reward pool dispatcher error")
                time.sleep(0.1)

    def _step(self) -> None:
        """Assign work, wait for a result / new task / deadline, then handle each."""
        self._assign()
        conns = [w.conn for w in self._workers]
        for conn in wait([*conns, self._wake_r], timeout=self._wait_timeout()):
            if conn is self._wake_r:
                self._drain_wake()
            else:
                self._receive(self._by_conn(conn))
        self._enforce_deadlines()

    def _wait_timeout(self) -> float:
        busy = [w.started for w in self._workers if w.jobs]
        if not busy:
            return 1.0
        return max(0.0, min(busy) + self.timeout_s - time.monotonic())

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _by_conn(self, conn: object) -> _Worker | None:
        return next((w for w in self._workers if w.conn is conn), None)

    def _next_job(self, ahead: bool) -> _Job | None:
        """The next queued job; when sending `ahead` of a busy worker, only a small one."""
        with self._lock:
            if not self._queue:
                return None
            if ahead and len(self._queue[0].payload) > PIPELINE_MAX_BYTES:
                return None
            return self._queue.popleft()

    def _assign(self) -> None:
        """Top every ready worker up to PIPELINE_DEPTH jobs, idle workers first."""
        for depth in range(PIPELINE_DEPTH):
            for worker in list(self._workers):
                if not worker.ready or len(worker.jobs) > depth:
                    continue
                job = self._next_job(ahead=depth > 0)
                if job is None:
                    return
                self._send(worker, job)

    def _send(self, worker: _Worker, job: _Job) -> None:
        if not worker.jobs:
            worker.started = time.monotonic()
        worker.jobs.append(job)
        try:
            worker.conn.send_bytes(job.payload)
        except OSError:  # it died: let _worker_died requeue (or fail) what it held
            self._worker_died(worker)

    def _receive(self, worker: _Worker | None) -> None:
        if worker is None:
            return
        try:
            msg = json.loads(worker.conn.recv_bytes())
        except (EOFError, OSError, ValueError):
            self._worker_died(worker)
            return
        if "ready" in msg:
            worker.ready = True
            self._startup_failures = 0
            return
        if worker.jobs:
            job = worker.jobs.popleft()
            worker.started = time.monotonic()  # the worker moves on to the next job now
            seconds = msg.pop("seconds")
            job.future.set_result(Outcome(Verdict(**msg), seconds))

    def _requeue_unstarted(self, worker: _Worker) -> _Job | None:
        """Put the jobs behind the oldest back in front of the queue; return the oldest."""
        if not worker.jobs:
            return None
        head, *waiting = worker.jobs
        worker.jobs.clear()
        with self._lock:
            self._queue.extendleft(reversed(waiting))
        return head

    def _worker_died(self, worker: _Worker) -> None:
        code, elapsed = worker.process.exitcode, time.monotonic() - worker.started
        job = self._requeue_unstarted(worker)
        self._replace(worker, "died")
        if job is None:
            return
        job.deaths += 1
        if job.deaths < MAX_DEATHS:  # it may have died before reading it: run it elsewhere
            with self._lock:
                self._queue.appendleft(job)
            return
        reason = f"verifier worker died (exit code {code}) on this item {job.deaths} times"
        job.future.set_result(_failed(job.task, reason, elapsed))

    def _enforce_deadlines(self) -> None:
        now = time.monotonic()
        for worker in list(self._workers):
            if not worker.jobs or now - worker.started < self.timeout_s:
                continue
            job = self._requeue_unstarted(worker)
            assert job is not None
            message = f"timeout: verification exceeded timeout_s={self.timeout_s:g}; worker killed"
            outcome = _failed(job.task, message, now - worker.started, timed_out=True)
            self._replace(worker, "timeout")
            job.future.set_result(outcome)

    # -- worker processes ---------------------------------------------------------

    def _spawn(self) -> _Worker:
        parent, child = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(
            target=worker_main, args=(child, self.soft_timeout_s), name="reward-verifier"
        )
        process.daemon = True
        process.start()
        child.close()
        return _Worker(process, parent)

    def _replace(self, worker: _Worker, reason: str) -> None:
        """Kill one worker and put a fresh one in its slot (once, however often called)."""
        was_ready = worker.ready
        self._stop_worker(worker)
        if self._closed.is_set() or worker not in self._workers:
            return
        if not was_ready:
            self._startup_failed(worker.process.exitcode)
        index = self._workers.index(worker)
        self._workers[index] = self._spawn()
        self.restarts += 1
        log.warning("reward verifier worker replaced (%s)", reason)
        self._on_restart(reason)

    def _startup_failed(self, exitcode: int | None) -> None:
        """A worker died before it was ready: back off instead of a respawn storm, and
        after a few in a row answer what waits, since no worker may ever start."""
        self._startup_failures += 1
        log.error("reward verifier worker failed to start (exit code %s)", exitcode)
        if self._startup_failures >= STARTUP_FAILURES_BEFORE_GIVING_UP:
            with self._lock:
                waiting, self._queue = list(self._queue), deque()
            for job in waiting:
                reason = f"verifier workers cannot start (exit code {exitcode})"
                job.future.set_result(_failed(job.task, reason))
        self._closed.wait(min(0.05 * 2**self._startup_failures, 5.0))

    @staticmethod
    def _stop_worker(worker: _Worker) -> None:
        worker.ready = False  # nothing more is sent to it
        if worker.process.is_alive():
            worker.process.kill()
        worker.process.join(timeout=5)
        worker.conn.close()


def _failed(task: Task, error: str, seconds: float = 0.0, timed_out: bool = False) -> Outcome:
    """The wrong-answer outcome that stands in for a failed verification."""
    return Outcome(Verdict(False, "", task.verifier, error), seconds, timed_out)
