"""What every data-parallel rank holds (`Trainer`) and how ranks > 0 follow rank 0.

Rank 0 (`learner.server`, through `Commander`) sends each `Command` as bytes (an op, an
int64 argument, a body); the other ranks run it (`Follower`). Every rank handles SIGTERM
by asking to stop, never by dying, since rank 0's checkpoint is a collective. The
command format: docs/architecture.md, "Data-parallel learner"; how the ranks stop
together: docs/reliability.md, "The learner as several ranks".
"""

from __future__ import annotations

import struct
import threading
from dataclasses import dataclass
from pathlib import Path

from learner.async_checkpoint import BackgroundWriter, WriteResult, write_latest
from learner.backends import build_policy
from learner.config import LearnerSettings
from learner.dist import DataParallel, data_parallel, pack_groups, unpack_groups
from learner.old_logprobs import OldLogprobGate
from learner.policy import Policy
from learner.reference import Reference
from learner.step import StepMetrics, train_step
from services.common.errors import DapoError
from services.common.types import Group

OP_STOP, OP_TRAIN, OP_CHECKPOINT, OP_EXPORT = range(4)
WRITE_BUSY, WRITE_FAILED = 1, 2  # a rank's checkpoint write, as `Trainer.settle` reduces it
HEADER = struct.Struct("<Bq")  # op, argument
VERSION = struct.Struct("<q")  # OP_TRAIN's body starts with the weights' policy version


@dataclass(frozen=True)
class Command:
    """One instruction from rank 0 to the other ranks."""

    op: int
    arg: int = 0
    body: bytes = b""

    def encode(self) -> bytes:
        return HEADER.pack(self.op, self.arg) + self.body

    @classmethod
    def decode(cls, message: bytes) -> Command:
        op, arg = HEADER.unpack_from(message)
        return cls(op, arg, message[HEADER.size :])

    @classmethod
    def train(cls, seed: int, version: int, groups: list[Group]) -> Command:
        return cls(OP_TRAIN, seed, VERSION.pack(version) + pack_groups(groups))

    def train_batch(self) -> tuple[int, list[Group]]:
        """OP_TRAIN's policy version and groups."""
        (version,) = VERSION.unpack_from(self.body)
        return version, unpack_groups(self.body[VERSION.size :])


def model_dir(config: LearnerSettings) -> str:
    path = config.model_path
    if path is None:
        raise DapoError("learner.model_path (or shared.model_path) is required")
    if not Path(path).is_dir():
        raise DapoError(f"model directory not found: {path}")
    return path


def pad_token_id(path: str) -> int:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0


def export_dir(config: LearnerSettings) -> Path | None:
    cfg = config.learner
    if cfg.checkpoint.export_dir:
        return Path(cfg.checkpoint.export_dir)
    return Path(cfg.checkpoint.dir) / "final" if cfg.checkpoint.dir else None


class Trainer:
    """What every rank holds: the policy and how to run each command."""

    def __init__(self, config: LearnerSettings, dp: DataParallel | None = None) -> None:
        self.config, self.model_path = config, model_dir(config)
        self.pad_id = pad_token_id(self.model_path)
        self.policy: Policy = build_policy(self.model_path, config.learner)
        objective = config.learner.objective.model_copy(update={"correction": config.correction})
        self.learner_config = config.learner.model_copy(update={"objective": objective})
        self.dp = dp or data_parallel()  # after the policy: DeepSpeed joins the group
        kl_on = config.learner.objective.kl_coef > 0
        self.reference = (
            Reference.load(self.model_path, config.learner.dtype, self.policy.device)
            if kl_on
            else None
        )
        self.old_logprobs = OldLogprobGate.from_config(config.learner.objective)
        self.writer = BackgroundWriter()  # this rank's checkpoint files

    def train(self, groups: list[Group], seed: int, version: int = 0) -> StepMetrics:
        """One step on `groups` with the weights of policy `version`."""
        cfg, shared = self.learner_config, self.config.shared
        metrics = train_step(
            self.policy,
            groups,
            cfg,
            self.pad_id,
            shared.sampling.temperature,
            shared.max_response_length,
            seed=seed,
            dp=self.dp,
            reference=self.reference,
            version=version,
            old_logprobs=self.old_logprobs,
        )
        self.policy.advance_schedule()
        return metrics

    def checkpoint(self, tag: str, client_state: dict, wait: bool) -> list[WriteResult]:
        """Settle the write in flight, then write `tag` (no tag: none) in the background,
        or wait for it too with `wait`; the writes finished on every rank (collective)."""
        directory = self.config.learner.checkpoint.dir
        assert directory
        done = [self.settle(wait=True)]
        if tag:
            writes = self.policy.checkpoint_snapshot(directory, tag, client_state)
            self.writer.start(tag, writes)
            if wait:
                done.append(self.settle(wait=True))
        return [r for r in done if r is not None]

    def settle(self, wait: bool) -> WriteResult | None:
        """The write in flight, once finished on every rank (then rank 0 points `latest`
        at it); None while one is writing. Collective while a write is in flight, which
        every rank started together; a failed write fails every rank."""
        if self.writer.tag is None:
            return None
        if wait:
            self.writer.wait()
        state = WRITE_BUSY if self.writer.busy else WRITE_FAILED * self.writer.failed
        state = self.dp.all_reduce_max(state)
        if state == WRITE_BUSY:
            return None
        result = self.writer.collect()
        if state == WRITE_FAILED:
            raise DapoError(f"checkpoint {result.tag} was not written: {result.error}")
        if self.dp.rank == 0:
            assert self.config.learner.checkpoint.dir
            write_latest(self.config.learner.checkpoint.dir, result.tag)
        return result

    def restore(self, resume: bool) -> dict | None:
        cfg = self.config.learner
        if not (resume and cfg.checkpoint.dir):
            return None
        return self.policy.load_checkpoint(cfg.checkpoint.dir)

    def export(self) -> None:
        out = export_dir(self.config)
        if out is not None:
            self.policy.save_pretrained(out, self.model_path)


class Follower:
    """A rank > 0: runs whatever rank 0 sends until told to stop."""

    def __init__(
        self,
        config: LearnerSettings,
        dp: DataParallel | None = None,
        stopping: threading.Event | None = None,
    ) -> None:
        self.stopping = stopping or threading.Event()  # set by this rank's SIGTERM
        self.trainer = Trainer(config, dp)
        resume = self.trainer.dp.broadcast_bytes(None) == b"\x01"  # Commander.resume
        self.trainer.restore(resume)
        self._gather()  # rank 0 snapshots the restored weights for its WeightService

    def _gather(self) -> None:
        for _ in self.trainer.policy.named_weights():  # ZeRO-3 gathers are collective
            pass

    def run(self) -> int:
        """Follow until OP_STOP; its exit code (0: the run is done)."""
        while True:
            command = Command.decode(self.trainer.dp.broadcast_bytes(None))
            if command.op == OP_STOP:
                if command.arg != 1:  # rank 0 closes the group too (not after an error)
                    self.trainer.dp.close()
                return command.arg
            if command.op == OP_TRAIN:
                version, groups = command.train_batch()
                self.trainer.settle(wait=False)  # as rank 0's `Checkpointer.poll`
                self.trainer.train(groups, seed=command.arg, version=version)
                any_rank_stopping(self.trainer.dp, self.stopping)
                self._gather()
            elif command.op == OP_CHECKPOINT:
                self.trainer.checkpoint(command.body.decode(), {}, wait=command.arg == 1)
            elif command.op == OP_EXPORT:
                self.trainer.export()


class Commander:
    """Rank 0's side of the protocol: sends each command to the followers (nothing to
    send on one rank); rank 0 then runs it itself."""

    def __init__(self, dp: DataParallel) -> None:
        self.dp = dp

    def tell(self, command: Command) -> None:
        if self.dp.world_size > 1:
            self.dp.broadcast_bytes(command.encode())

    def resume(self, resume: bool) -> None:
        """Whether every rank restores its checkpoint (`Follower.__init__` waits for it)."""
        if self.dp.world_size > 1:
            self.dp.broadcast_bytes(b"\x01" if resume else b"\x00")

    def train(self, seed: int, version: int, groups: list[Group]) -> None:
        self.tell(Command.train(seed, version, groups))

    def checkpoint(self, tag: str, wait: bool) -> None:
        """`Trainer.checkpoint(tag, wait=wait)` on every rank (no tag: settle only)."""
        self.tell(Command(OP_CHECKPOINT, int(wait), tag.encode()))

    def export(self) -> None:
        self.tell(Command(OP_EXPORT))

    def stop(self, code: int) -> None:
        self.tell(Command(OP_STOP, code))


def any_rank_stopping(dp: DataParallel, stopping: threading.Event) -> bool:
    """After each step, on every rank: whether any rank was asked to stop (then all know)."""
    if dp.all_reduce_max(int(stopping.is_set())):
        stopping.set()
    return stopping.is_set()
