"""Rank 0's checkpoints, and the acks that wait for them.

With `checkpoint.dir`, a step's `train` entries are acked (and counted `trained`) only
once a checkpoint holding their effect is on disk (every `checkpoint.every` steps, on
stop, at the end); the checkpoint records the id of the last trained entry (the cursor).
Without one, nothing waits: the step's own transaction acks its entries. Each checkpoint
directory is stamped with the run's id (`run_id`): a learner never restores another run's.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from prometheus_client import Counter

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
    """Writes checkpoints on every rank (rank 0 tells the others) and then acks."""

    def __init__(
        self, config: LearnerSettings, trainer: Trainer, ranks: Commander, stream: TrainStream
    ) -> None:
        self.config, self.trainer, self.ranks, self.stream = config, trainer, ranks, stream
        self.unacked: list[str] = []  # trained entries no checkpoint holds yet
        self.last_step = 0
        self.run_id: str | None = None  # the run's id (Redis `run_id`), when it has one

    @property
    def enabled(self) -> bool:
        return self.config.learner.checkpoint.dir is not None

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

    def checkpoint(self, step: int, version: int, cursor: str) -> None:
        """Checkpoint to disk, then ack and count the entries it holds."""
        if not self.enabled or step == self.last_step:
            return
        tag = f"step{step}"
        state = {"step": step, "version": version, "cursor": cursor, "run_id": self.run_id}
        self._stamp()
        self.ranks.checkpoint(tag)
        self.trainer.checkpoint(tag, state)
        self.stream.ack_trained(self.unacked)
        self.unacked, self.last_step = [], step
        CHECKPOINTS.inc()
        log.info("checkpoint %s version=%d cursor=%s", tag, version, cursor)

    def _stamp(self) -> None:
        directory = self.config.learner.checkpoint.dir
        if self.run_id is None or directory is None:
            return
        Path(directory).mkdir(parents=True, exist_ok=True)
        check_owner(directory, self.run_id)  # never write beside another run's
        (Path(directory) / RUN_STAMP).write_text(self.run_id)
