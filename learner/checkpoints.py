"""Rank 0's checkpoints, and the acks that wait for them.

With `checkpoint.dir`, a step's `train` entries are acked (and counted `trained`) only
once a checkpoint holding their effect is on disk (every `checkpoint.every` steps, on
stop, at the end); the checkpoint records the id of the last trained entry (the cursor).
Without one, nothing waits: the step's own transaction acks its entries. Each checkpoint
directory is stamped with the run's id (`run_id`): a learner never restores another run's.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from prometheus_client import Counter

from learner.async_checkpoint import WriteResult
from learner.config import LearnerSettings
from learner.train_stream import TrainStream
from learner.trainer import Commander, Trainer
from services.common.errors import DapoError

log = logging.getLogger(__name__)

CHECKPOINTS = Counter("dapo_learner_checkpoints_total", "Checkpoints written")
RUN_STAMP = "run_id"  # file in checkpoint.dir: the id of the run whose checkpoints these are


def stamped_run(directory: str | Path) -> str | None:
    """The run id a checkpoint directory is stamped with (None: unstamped)."""
    path = Path(directory) / RUN_STAMP
    return path.read_text().strip() if path.is_file() else None


def check_owner(directory: str | Path, run_id: str | None) -> None:
    """Refuse a checkpoint directory that holds another run's checkpoints (one whose
    stamp differs, or an unstamped one with checkpoints in it)."""
    if run_id is None or not (Path(directory) / "latest").is_file():
        return
    owner = stamped_run(directory)
    if owner != run_id:
        raise DapoError(
            f"{directory} holds the checkpoints of run {owner or '(unknown: no run_id)'}, not "
            f"of this run {run_id}: not loading them (`dapo up --fresh` moves the old run "
            "aside; or set learner.checkpoint.dir)"
        )


class Checkpointer:
    """Checkpoints on every rank (rank 0 tells the others), in the background
    (`checkpoint.async_write`), and acks what a finished checkpoint holds."""

    def __init__(
        self, config: LearnerSettings, trainer: Trainer, ranks: Commander, stream: TrainStream
    ) -> None:
        self.config, self.trainer, self.ranks, self.stream = config, trainer, ranks, stream
        self.unacked: list[str] = []  # trained entries no checkpoint holds yet
        self.writing: dict[str, list[str]] = {}  # tag being written -> the entries it holds
        self.last_step = 0
        self.run_id: str | None = None  # the run's id (Redis `run_id`), when it has one
        self.stop_seen: float | None = None  # monotonic time the learner saw its stop
        self.measured: WriteResult | None = None  # the last finished write

    @property
    def enabled(self) -> bool:
        return self.config.learner.checkpoint.dir is not None

    @property
    def not_acked(self) -> int:
        return len(self.unacked) + sum(len(ids) for ids in self.writing.values())

    def restore(self, resume: bool) -> dict[str, Any] | None:
        """The restored checkpoint's state (step, version, cursor), or None; refuses
        another run's checkpoints."""
        directory = self.config.learner.checkpoint.dir
        if resume and directory is not None:
            check_owner(directory, self.run_id)
        state = self.trainer.restore(resume)
        if state is not None:
            self.last_step = int(state["step"])
        return state

    def hold(self, ids: list[str]) -> None:
        """Entries a step trained: acked by the next checkpoint (nothing to hold without)."""
        if self.enabled:
            self.unacked += ids

    def due(self, step: int) -> bool:
        return self.enabled and step % self.config.learner.checkpoint.every == 0

    def poll(self) -> None:
        """Before each step on every rank: ack a background write finished everywhere."""
        if self.enabled:
            self._settled(self.trainer.settle(wait=False))

    def checkpoint(self, step: int, version: int, cursor: str, final: bool = False) -> None:
        """Checkpoint, then ack and count the entries it holds once it is written: in the
        background, or now when `final` (the stop's or the run's last, which also waits
        for the write in flight) or without `async_write`. A stop's checkpoint that would
        not fit its budget is skipped (`stop_budget`)."""
        if not self.enabled:
            return
        tag = f"step{step}" if step != self.last_step and self._fits(final) else ""
        wait = final or not self.config.learner.checkpoint.async_write
        if not tag and not (final and self.trainer.writer.tag):
            return  # (a final one still waits for the write in flight)
        state = {"step": step, "version": version, "cursor": cursor, "run_id": self.run_id}
        if tag:
            self._stamp()
            self.writing[tag], self.unacked, self.last_step = self.unacked, [], step
        started = time.monotonic()
        self.ranks.checkpoint(tag, wait)
        for result in self.trainer.checkpoint(tag, state, wait):
            self._settled(result)
        if final and tag and self.stop_seen is not None:
            log.info(
                "stop checkpoint %s written in %.2fs (budget %.1fs)",
                tag,
                time.monotonic() - started,
                self.stop_budget(started),
            )
        if tag:
            done = "written" if wait else "started"
            log.info("checkpoint %s %s version=%d cursor=%s", tag, done, version, cursor)

    def stop_budget(self, now: float) -> float:
        """Seconds a stop's checkpoint may take: what is left of the shutdown timeout
        since the stop was seen (torchrun, `dapo up` and a pod's grace period SIGKILL
        after it), less a tenth for the exit."""
        timeout = self.config.learner.launch.shutdown_timeout_s
        seen = self.stop_seen if self.stop_seen is not None else now
        return 0.9 * timeout - (now - seen)

    def _fits(self, final: bool) -> bool:
        """Whether a stop's checkpoint is expected to fit its budget, from the last
        write's measured rate (unknown: it is written)."""
        if not final or self.stop_seen is None or self.measured is None:
            return True
        expected = self.measured.seconds
        budget = self.stop_budget(time.monotonic())
        if expected <= budget:
            return True
        log.warning(
            "not checkpointing at stop: the last write took %.1fs, %.1fs are left of "
            "learner.launch.shutdown_timeout_s; the steps since step %d are trained again "
            "after the restart",
            expected,
            budget,
            self.last_step,
        )
        return False

    def _settled(self, result: WriteResult | None) -> None:
        if result is None:
            return
        self.stream.ack_trained(self.writing.pop(result.tag, []))
        self.measured = result
        CHECKPOINTS.inc()
        rate = result.nbytes / max(result.seconds, 1e-9) / 1e6
        log.info(
            "checkpoint %s complete: %.1f MB in %.2fs (%.0f MB/s)",
            result.tag,
            result.nbytes / 1e6,
            result.seconds,
            rate,
        )

    def _stamp(self) -> None:
        directory = self.config.learner.checkpoint.dir
        if self.run_id is None or directory is None:
            return
        Path(directory).mkdir(parents=True, exist_ok=True)
        check_owner(directory, self.run_id)  # never write beside another run's
        (Path(directory) / RUN_STAMP).write_text(self.run_id)
