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


@dataclass
class _Worker:
    process: Any  # a multiprocessing Process of the pool's context
    conn: Connection
    ready: bool = False
    job: _Job | None = None
    started: float = 0.0


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
        job = _Job(task)
        if self._closed.is_set():
            job.future.set_result(_failed(task, "reward pool is shut down"))
            return job.future
        with self._lock:
            self._queue.append(job)
        self._wake()
        return job.future

    def run_all(self, tasks: Sequence[Task]) -> list[Outcome]:
        """Submit every task, wait for all; results in input order."""
        futures = [self.submit(t) for t in tasks]
        return [f.result() for f in futures]

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
        busy = [w.started for w in self._workers if w.job is not None]
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

    def _next_job(self) -> _Job | None:
        with self._lock:
            return self._queue.popleft() if self._queue else None

    def _assign(self) -> None:
        for worker in self._workers:
            if not worker.ready or worker.job is not None:
                continue
            job = self._next_job()
            if job is None:
                return
            self._send(worker, job)

    def _send(self, worker: _Worker, job: _Job) -> None:
        payload = {"verifier": job.task.verifier, "response": job.task.response}
        payload["ground_truth"] = job.task.ground_truth
        worker.job, worker.started = job, time.monotonic()
        try:
            worker.conn.send_bytes(json.dumps(payload).encode())
        except OSError:  # it died while idle: the task never started, so run it elsewhere
            worker.job = None
            with self._lock:
                self._queue.appendleft(job)
            self._replace(worker, "died")

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
            return
        job, worker.job = worker.job, None
        if job is not None:
            seconds = msg.pop("seconds")
            job.future.set_result(Outcome(Verdict(**msg), seconds))

    def _worker_died(self, worker: _Worker) -> None:
        code = worker.process.exitcode
        job, worker.job = worker.job, None
        self._replace(worker, "died")
        if job is None:
            return
        job.deaths += 1
        if job.deaths < MAX_DEATHS:  # it may have died before reading it: run it elsewhere
            with self._lock:
                self._queue.appendleft(job)
            return
        reason = f"verifier worker died (exit code {code}) on this item {job.deaths} times"
        job.future.set_result(_failed(job.task, reason, time.monotonic() - worker.started))

    def _enforce_deadlines(self) -> None:
        now = time.monotonic()
        for worker in list(self._workers):
            job = worker.job
            if job is None or now - worker.started < self.timeout_s:
                continue
            worker.job = None
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
        """Kill one worker and put a fresh one in its slot."""
        self._stop_worker(worker)
        if self._closed.is_set():
            return
        index = self._workers.index(worker)
        self._workers[index] = self._spawn()
        self.restarts += 1
        log.warning("reward verifier worker replaced (%s)", reason)
        self._on_restart(reason)

    @staticmethod
    def _stop_worker(worker: _Worker) -> None:
        if worker.process.is_alive():
            worker.process.kill()
        worker.process.join(timeout=5)
        worker.conn.close()


def _failed(task: Task, error: str, seconds: float = 0.0, timed_out: bool = False) -> Outcome:
    """The wrong-answer outcome that stands in for a failed verification."""
    return Outcome(Verdict(False, "", task.verifier, error), seconds, timed_out)
