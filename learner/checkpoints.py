"""Rank 0's checkpoints, and the acks that wait for them.

With `checkpoint.dir`, a step's `train` entries are acked (and counted `trained`) only
once a checkpoint holding their effect is on disk (every `checkpoint.every` steps, on
stop, at the end); the checkpoint records the id of the last trained entry (the cursor).
Without one, nothing waits: the step's own transaction acks its entries.
"""

from __future__ import annotations

import logging
from typing import Any

from prometheus_client import Counter

from learner.config import LearnerSettings
from learner.train_stream import TrainStream
from learner.trainer import Commander, Trainer

log = logging.getLogger(__name__)

CHECKPOINTS = Counter("dapo_learner_checkpoints_total", "Checkpoints written")


class Checkpointer:
    """Writes checkpoints on every rank (rank 0 tells the others) and then acks."""

    def __init__(
        self, config: LearnerSettings, trainer: Trainer, ranks: Commander, stream: TrainStream
    ) -> None:
        self.config, self.trainer, self.ranks, self.stream = config, trainer, ranks, stream
        self.unacked: list[str] = []  # trained entries no checkpoint holds yet
        self.last_step = 0

    @property
    def enabled(self) -> bool:
        return self.config.learner.checkpoint.dir is not None

    def restore(self, resume: bool) -> dict[str, Any] | None:
        """The restored checkpoint's state (step, version, cursor), or None."""
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
        state = {"step": step, "version": version, "cursor": cursor}
        self.ranks.checkpoint(tag)
        self.trainer.checkpoint(tag, state)
        self.stream.ack_trained(self.unacked)
        self.unacked, self.last_step = [], step
        CHECKPOINTS.inc()
        log.info("checkpoint %s version=%d cursor=%s", tag, version, cursor)
