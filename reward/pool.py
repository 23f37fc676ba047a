"""A pool of killable verifier processes with a hard per-item timeout.

math-verify's timeouts need a process's main thread and some inputs hold the GIL in C
code, so each item runs in a worker process, and a worker whose item runs past
`timeout_s` is killed and replaced; a worker that dies on its own is replaced too, and
nothing is lost. Why, how work goes out in chunks and how deadlines are kept:
docs/reward.md, "Time bounds" and "How the pool spends (little) time on each item".
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from multiprocessing.connection import wait
from multiprocessing.context import ForkServerContext, SpawnContext

from reward.jobs import (
    MAX_CHUNK_BYTES,
    MAX_DEATHS,
    Job,
    Outcome,
    Task,
    Worker,
    chunk_size,
    default_num_workers,
    fail_all,
    failed,
    job_for,
)
from reward.worker import Progress, decode_reply, encode_chunk, worker_main

log = logging.getLogger(__name__)

PRELOAD = ["reward.verifiers", "reward.preload", "reward.worker"]
STARTUP_FAILURES_BEFORE_GIVING_UP = 5


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
        if start_method not in ("forkserver", "spawn"):
            raise ValueError(f"start_method must be forkserver or spawn, not {start_method!r}")
        self._ctx: SpawnContext | ForkServerContext = (
            mp.get_context("spawn") if start_method == "spawn" else mp.get_context("forkserver")
        )
        if start_method == "forkserver":
            self._ctx.set_forkserver_preload(PRELOAD)
        self._on_restart = on_restart or (lambda reason: None)
        self._queue: deque[Job] = deque()
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._workers: list[Worker] = []
        self._closed = threading.Event()
        self._startup_failures = 0  # consecutive workers that died before becoming ready
        self._thread = threading.Thread(target=self._run, name="reward-pool", daemon=True)
        self.restarts = 0
        self.chunks_sent = 0  # messages carrying work to workers (status, tests)

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
        return self.submit_all([task])[0]

    def submit_all(self, tasks: Sequence[Task]) -> list[Future[Outcome]]:
        """Queue tasks in one go (one lock, one wake-up); futures in input order."""
        jobs = [job_for(task) for task in tasks]
        if not jobs:
            return []
        if self._closed.is_set():
            fail_all(jobs, "reward pool is shut down")
        else:
            with self._lock:
                self._queue.extend(jobs)
            self._wake()
        return [job.future for job in jobs]

    def run_all(self, tasks: Sequence[Task]) -> list[Outcome]:
        """Submit every task, wait for all; results in input order."""
        return [f.result() for f in self.submit_all(tasks)]

    def close(self) -> None:
        """Stop the dispatcher and the workers; pending tasks get an error outcome."""
        self._closed.set()
        self._wake()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        for worker in list(self._workers):
            self._stop_worker(worker)
            fail_all(worker.jobs, "reward pool is shut down")
        self._workers.clear()
        with self._lock:
            pending, self._queue = list(self._queue), deque()
        fail_all(pending, "reward pool is shut down")
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
        """Assign work, wait for results / new tasks / a deadline, then handle each."""
        self._assign()
        conns = [w.conn for w in self._workers]
        for conn in wait([*conns, self._wake_r], timeout=self._wait_timeout()):
            if conn is self._wake_r:
                self._drain_wake()
            else:
                self._receive(self._by_conn(conn))
        self._enforce_deadlines()

    def _wait_timeout(self) -> float:
        """Until the earliest deadline of an item now running (re-read on waking)."""
        busy = [w.current()[1] for w in self._workers if w.jobs]
        if not busy:
            return 1.0
        return max(0.0, min(busy) + self.timeout_s - time.monotonic())

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _by_conn(self, conn: object) -> Worker | None:
        return next((w for w in self._workers if w.conn is conn), None)

    def _take_chunk(self) -> list[Job]:
        """The next chunk from the front of the queue (empty when the queue is)."""
        with self._lock:
            chunk: list[Job] = []
            size, nbytes = chunk_size(len(self._queue), self.num_workers), 0
            while self._queue and len(chunk) < size:
                nbytes += len(self._queue[0].payload)
                if chunk and nbytes > MAX_CHUNK_BYTES:
                    break
                chunk.append(self._queue.popleft())
            return chunk

    def _assign(self) -> None:
        """Give every idle ready worker a chunk."""
        for worker in list(self._workers):
            if not worker.ready or worker.jobs:
                continue
            chunk = self._take_chunk()
            if not chunk:
                return
            self._send(worker, chunk)

    def _send(self, worker: Worker, chunk: list[Job]) -> None:
        worker.jobs.extend(chunk)
        worker.answered = 0
        worker.sent_at = worker.heard_at = time.monotonic()
        self.chunks_sent += 1
        try:  # the worker is idle, so it is reading: this cannot block on a full pipe
            worker.conn.send_bytes(encode_chunk([job.payload for job in chunk]))
        except OSError:  # it died: let _worker_died requeue (or fail) what it held
            self._worker_died(worker)

    def _receive(self, worker: Worker | None) -> None:
        if worker is None:
            return
        try:
            reply = decode_reply(worker.conn.recv_bytes())
        except (EOFError, OSError, ValueError, TypeError, KeyError):
            self._worker_died(worker)
            return
        if isinstance(reply, int):
            worker.ready = True
            self._startup_failures = 0
            return
        worker.heard_at = time.monotonic()
        for verdict, seconds in reply:
            if not worker.jobs:  # more verdicts than items: a confused worker
                break
            worker.answered += 1
            worker.jobs.popleft().future.set_result(Outcome(verdict, seconds))

    def _take_back(self, worker: Worker) -> Job | None:
        """Empty the worker: its current item is returned, every other unanswered item
        goes back to the front of the queue in order (nothing is lost)."""
        if not worker.jobs:
            return None
        position, _ = worker.current()
        jobs = list(worker.jobs)
        worker.jobs.clear()
        culprit = jobs.pop(min(position, len(jobs) - 1))
        with self._lock:
            self._queue.extendleft(reversed(jobs))
        return culprit

    def _worker_died(self, worker: Worker) -> None:
        code, elapsed = worker.process.exitcode, time.monotonic() - worker.current()[1]
        job = self._take_back(worker)
        self._replace(worker, "died")
        if job is None:
            return
        job.deaths += 1
        if job.deaths < MAX_DEATHS:  # it may have died before reading it: run it elsewhere
            with self._lock:
                self._queue.appendleft(job)
            return
        reason = f"verifier worker died (exit code {code}) on this item {job.deaths} times"
        job.future.set_result(failed(job.task, reason, elapsed))

    def _enforce_deadlines(self) -> None:
        now = time.monotonic()
        for worker in list(self._workers):
            if not worker.jobs:
                continue
            started = worker.current()[1]
            if now - started < self.timeout_s:
                continue
            job = self._take_back(worker)
            assert job is not None
            message = f"timeout: verification exceeded timeout_s={self.timeout_s:g}; worker killed"
            outcome = failed(job.task, message, now - started, timed_out=True)
            self._replace(worker, "timeout")
            job.future.set_result(outcome)

    # -- worker processes ---------------------------------------------------------

    def _spawn(self) -> Worker:
        parent, child = self._ctx.Pipe(duplex=True)
        progress = self._ctx.RawArray("q", 1)
        process = self._ctx.Process(
            target=worker_main,
            args=(child, progress, self.soft_timeout_s),
            name="reward-verifier",
        )
        process.daemon = True
        process.start()
        child.close()
        return Worker(process, parent, Progress(progress))

    def _replace(self, worker: Worker, reason: str) -> None:
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
            fail_all(waiting, f"verifier workers cannot start (exit code {exitcode})")
        self._closed.wait(min(0.05 * 2**self._startup_failures, 5.0))

    @staticmethod
    def _stop_worker(worker: Worker) -> None:
        worker.ready = False  # nothing more is sent to it
        if worker.process.is_alive():
            worker.process.kill()
        worker.process.join(timeout=5)
        worker.conn.close()
