"""The learner service: reads informative groups from `train`, trains, publishes weights.

One step: train on N groups → snapshot the new weights into the WeightService → in one
Redis transaction set the version and append the step's metrics. When are the N entries
acked (and counted `trained`)?

- with `checkpoint_dir`: only once a checkpoint holding their effect is on disk (every
  `checkpoint_every` steps, on stop, at the end). The checkpoint records the id of the
  last trained entry (the cursor); after a crash the restarted learner restores the
  checkpoint, acks-and-counts the pending entries up to the cursor without training them
  again, and trains the rest again, in stream order;
- without: in the step's own transaction (nothing survives a crash anyway).

Versions never go backwards for rollout servers: a learner restored to an older
checkpoint than the version in Redis publishes its weights as that version + 1.
Groups past the hard staleness bound (`services/common/staleness.py`, the rule the buffer
also applies) are acked and counted `dropped:stale` in one transaction at once; groups
between the soft and the hard bound are trained, with the off-policy correction.

With several data-parallel ranks (torchrun), rank 0 runs everything above and sends
each command (train these groups / checkpoint / export / stop) to the other ranks as
bytes; they follow (`learner.trainer.Follower`).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import redis
from prometheus_client import Counter, Gauge

from learner.config import LearnerSettings
from learner.publisher import BackgroundPublisher
from learner.step import StepMetrics
from learner.trainer import (
    OP_CHECKPOINT,
    OP_EXPORT,
    OP_STOP,
    Command,
    Trainer,
    any_rank_stopping,
)
from learner.weights import WeightServicer, add_weight_service, open_weight_socket, stream_views
from services.common.adapters import decode_group
from services.common.atomic import ack_then, commit_step
from services.common.generation_budget import batch_ready, decided_groups
from services.common.grpc_server import start_grpc_server
from services.common.http import HttpServer, create_http_app, serve_http
from services.common.keys import RunKeys
from services.common.redis_server import connect_run
from services.common.registry import Registration
from services.common.service import register
from services.common.staleness import judge, staleness
from services.common.streams import Entry, StreamConsumer
from services.common.types import Group
from services.weight_transport.tensor_codec import RawTensor
from services.weight_transport.weight_socket import WeightSocketServer

log = logging.getLogger(__name__)

STEP_GAUGES = {
    name: Gauge(f"dapo_learner_{name}", f"Last step's {name.replace('_', ' ')}")
    for name in StepMetrics().as_dict()
}
VERSION = Gauge("dapo_learner_policy_version", "Latest committed policy version")
STALENESS = Gauge("dapo_learner_batch_max_staleness", "Max staleness of the last batch")
GROUPS = Counter("dapo_learner_groups_total", "Groups consumed", ["outcome"])
for _outcome in ("trained", "dropped_stale"):  # at 0 from the start: a panel shows 0, not "No data"
    GROUPS.labels(_outcome)
STALE_TRAINED = Counter(
    "dapo_learner_stale_groups_trained_total",
    "Groups trained past the soft staleness bound (within the hard one, corrected)",
)
CHECKPOINTS = Counter("dapo_learner_checkpoints_total", "Checkpoints written")
SHORT_STEPS = Counter(
    "dapo_learner_short_steps_total",
    "Steps trained on fewer than train_batch_groups groups (learner.generation_budget spent)",
)
CONSUMER_GROUP = "learner"
STOPPED_EXIT = 143  # stopped before total_steps (128 + SIGTERM): a supervisor restarts it


def stream_id(entry_id: str) -> tuple[int, int]:
    """A Redis stream id as a comparable (ms, seq)."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


class Learner:
    """Rank 0: the consumer on `train`, the commit protocol, the weight service."""

    def __init__(
        self,
        config: LearnerSettings,
        client: redis.Redis,
        weight_socket: WeightSocketServer | None = None,
        trainer: Trainer | None = None,
    ) -> None:
        self.config, self.client = config, client
        self.keys = RunKeys(config.shared.run_name)
        self.trainer = trainer or Trainer(config)
        self.policy = self.trainer.policy
        self.consumer = StreamConsumer(client, self.keys.train, CONSUMER_GROUP, "learner-0")
        self.weights = WeightServicer(config.learner.weight_bucket_bytes, weight_socket)
        self.publisher = BackgroundPublisher(self.weights)  # off the step's critical path
        self.step, self.version, self.cursor = 0, 0, "0-0"
        self.unacked: list[str] = []
        self.last_checkpoint_step = 0
        self._pending_after: str | None = "0-0"  # replay own pending entries first
        self.last: StepMetrics | None = None
        self._batch: list[tuple[Entry, Group]] = []
        self._stop = threading.Event()  # `run`'s: a signal, or any rank's after a step
        self._decided_mark = self._decided()  # the generation budget counts from here
        self._generated = 0  # groups decided while the batch being trained filled
        self._restore()

    @property
    def checkpointing(self) -> bool:
        return self.config.learner.checkpoint_dir is not None

    def _restore(self) -> None:
        """Checkpoint state, then a version newer than anything rollout servers hold.
        Once the run has a version, restore even without `resume` (compose and Kubernetes
        restart the learner with the same command: never publish the base model anew)."""
        published = int(self.client.get(self.keys.version) or 0)
        resume = self.config.learner.resume or published > 0
        if self.trainer.dp.world_size > 1:
            self.trainer.dp.broadcast_bytes(b"\x01" if resume else b"\x00")
        state = self.trainer.restore(resume)
        if state is not None:
            self.step, self.version = int(state["step"]), int(state["version"])
            self.cursor = str(state["cursor"])
            self.last_checkpoint_step = self.step
            log.info("resumed step=%d version=%d cursor=%s", self.step, self.version, self.cursor)
        if published > self.version:  # a lost learner got further: its weights are gone
            self.version = published + 1
            self.client.set(self.keys.version, self.version)
        self.weights.publish(self.version, *self._weights())
        VERSION.set(self.version)

    def _weights(self) -> tuple[Iterator[RawTensor], int]:
        """The policy's weights as `publish` streams them (gathered bucket by bucket)."""
        return stream_views(self.policy.named_weights()), self.policy.weight_count()

    # --------------------------------------------------------------- consuming
    def _drop_stale(self, entry: Entry) -> None:
        k = self.keys
        ack_then(self.client, k.train, CONSUMER_GROUP, [entry.id], k.ledger, ["dropped:stale"])
        GROUPS.labels("dropped_stale").inc()

    def _ack_trained(self, ids: list[str]) -> None:
        """Ack and count `trained`; entries already acked are not counted again."""
        ack_then(self.client, self.keys.train, CONSUMER_GROUP, ids, self.keys.ledger, ["trained"])

    def _verdict(self, group: Group) -> str:
        shared = self.config.shared
        lag = staleness(group, self.version)
        return judge(lag, shared.max_staleness, shared.staleness_hard_bound)

    def take(self, entries: list[Entry]) -> None:
        """Add groups within the hard staleness bound to the batch; drop (and count) others.

        Entries up to the checkpoint cursor were trained before a crash: ack them only.
        """
        done = stream_id(self.cursor)
        self._ack_trained([e.id for e in entries if stream_id(e.id) <= done])
        for entry in (e for e in entries if stream_id(e.id) > done):
            group = decode_group(entry.fields["group"])
            if self._verdict(group) == "too_stale":
                self._drop_stale(entry)
            else:
                self._batch.append((entry, group))

    def _recheck_held(self) -> None:
        """Drop held groups that the last step pushed past the hard bound."""
        held, self._batch = self._batch, []
        for entry, group in held:
            if self._verdict(group) == "too_stale":
                self._drop_stale(entry)
            else:
                self._batch.append((entry, group))

    def _read_pending(self, count: int) -> list[Entry]:
        """The next page of entries delivered before a restart and never acked."""
        assert self._pending_after is not None
        entries = self.consumer.read_own_pending(count, after=self._pending_after)
        if entries:
            self._pending_after = entries[-1].id
        else:
            self._pending_after = None
        return entries

    def _decided(self) -> int:
        """Groups the buffer has decided so far (kept + filtered), from the ledger."""
        raw = self.client.hgetall(self.keys.ledger)
        return decided_groups({k.decode(): int(v) for k, v in raw.items()})

    def _ready(self, need: int) -> bool:
        """The batch is full, or `learner.generation_budget` is spent and it holds a group
        (services/common/generation_budget.py); then the next budget starts counting."""
        decided = self._decided()
        generated = decided - self._decided_mark
        budget = self.config.learner.generation_budget
        if not batch_ready(len(self._batch), need, generated, budget):
            return False
        self._decided_mark, self._generated = decided, generated
        return True

    def fill_batch(self, stop: threading.Event) -> bool:
        """Block until train_batch_groups fresh groups are held, or fewer once the
        generation budget is spent (False if stopping)."""
        if stop.is_set():
            return False
        need = self.config.shared.train_batch_groups
        self._recheck_held()
        while self._pending_after is not None and len(self._batch) < need:
            self.take(self._read_pending(need - len(self._batch)))
        while not self._ready(need):
            if stop.is_set():
                return False
            self.take(self.consumer.read(need - len(self._batch), block_ms=200))
        return True

    # --------------------------------------------------------------- training
    def _tell(self, command: Command) -> None:
        """Send a command to the follower ranks (nothing to do on one rank)."""
        if self.trainer.dp.world_size > 1:
            self.trainer.dp.broadcast_bytes(command.encode())

    def train_once(self) -> StepMetrics:
        need = self.config.shared.train_batch_groups
        batch, self._batch = self._batch[:need], self._batch[need:]
        groups = [g for _, g in batch]
        seed = self.config.shared.seed + self.step
        self.publisher.settle()  # the last version's weights are copied: they may change
        self._tell(Command.train(seed, self.version, groups))
        metrics = self.trainer.train(groups, seed, self.version)
        if any_rank_stopping(self.trainer.dp, self._stop):  # before commit's collectives
            log.info("stop requested: checkpointing after this step")
        lag = max(staleness(g, self.version) for g in groups)
        beyond = sum(self._verdict(g) == "stale_trained" for g in groups)
        STALE_TRAINED.inc(beyond)
        if len(groups) < need:
            SHORT_STEPS.inc()
            log.info(
                "step %d trains %d of %d groups: %d generated since the last batch spent the "
                "generation budget",
                self.step + 1,
                len(groups),
                need,
                self._generated,
            )
        self.commit([e.id for e, _ in batch], metrics, lag, [g.group_id for g in groups], beyond)
        return metrics

    def commit(
        self,
        ids: list[str],
        metrics: StepMetrics,
        staleness: int,
        group_ids: list[str],
        beyond_soft: int = 0,
    ) -> None:
        """Publish weights, then version + metrics + trace (+ acks without checkpoints).

        One script, once per version; `stepped` is for admission pacing only (not the
        ledger); the `steps` trace names the groups in this step (the fault tests read it).
        """
        new_version = self.version + 1
        if self.config.learner.publish_in_background:
            overlap = self.policy.weight_copy_overlaps  # the copy runs until the next step
            self.publisher.submit(new_version, *self._weights(), overlap=overlap)
        else:
            self.weights.publish(new_version, *self._weights())
        step = self.step + 1
        record = dict(
            metrics.as_dict(),
            step=step,
            staleness=staleness,
            beyond_soft=beyond_soft,
            groups=len(ids),
            generated=self._generated,
        )
        trace = {"step": step, "version": new_version, "groups": group_ids, "entries": ids}
        commit_step(
            self.client,
            self.keys,
            new_version,
            len(ids),
            json.dumps(record),
            json.dumps(trace),
            None if self.checkpointing else (CONSUMER_GROUP, ids),
        )
        self.step, self.version, self.last = self.step + 1, new_version, metrics
        self.cursor = max([self.cursor, *ids], key=stream_id)
        if self.checkpointing:
            self.unacked += ids
        self._observe(metrics, staleness, len(ids))
        if self.checkpointing and self.step % self.config.learner.checkpoint_every == 0:
            self.checkpoint()

    def _observe(self, metrics: StepMetrics, staleness: int, groups: int) -> None:
        for name, value in metrics.as_dict().items():
            STEP_GAUGES[name].set(value)
        VERSION.set(self.version)
        STALENESS.set(staleness)
        GROUPS.labels("trained").inc(groups)

    def checkpoint(self) -> None:
        """Checkpoint to disk, then ack and count the entries it holds."""
        if not self.checkpointing or self.step == self.last_checkpoint_step:
            return
        tag = f"step{self.step}"
        state = {"step": self.step, "version": self.version, "cursor": self.cursor}
        self._tell(Command(OP_CHECKPOINT, 0, tag.encode()))
        self.trainer.checkpoint(tag, state)
        self._ack_trained(self.unacked)
        self.unacked, self.last_checkpoint_step = [], self.step
        CHECKPOINTS.inc()
        log.info("checkpoint %s version=%d cursor=%s", tag, self.version, self.cursor)

    def run(self, stop: threading.Event) -> None:
        """Train to `total_steps` or until stopped, then checkpoint; the other ranks exit
        with 0 when the run is done, 143 when it stopped early, 1 on an error."""
        self._stop = stop
        total, code = self.config.learner.total_steps, 1
        try:
            while self.step < total and self.fill_batch(stop):
                m = self.train_once()
                log.info(
                    "step=%d loss=%.4f acc=%.3f entropy=%.3f grad_norm=%.3f mismatch=%.2e "
                    "lag=%.2f %.0f tok/s %.2fs",
                    self.step,
                    m.loss,
                    m.accuracy,
                    m.entropy,
                    m.grad_norm,
                    m.engine_mismatch,
                    m.policy_lag,
                    m.tokens_per_s,
                    m.seconds,
                )
            self.publisher.wait()  # the last version is served before the run ends
            self.checkpoint()
            if self.step >= total:
                self._tell(Command(OP_EXPORT))
                self.trainer.export()
                self.client.set(self.keys.done, self.version)
                log.info("reached total_steps=%d; run done", total)
            code = 0 if self.step >= total else STOPPED_EXIT
        finally:
            self._tell(Command(OP_STOP, code))
            if code != 1:  # every rank got here: close the group together
                self.trainer.dp.close()

    def status(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "step": self.step,
            "cursor": self.cursor,
            "unacked": len(self.unacked),
            "batch_held": len(self._batch),
            "last_step": self.last.as_dict() if self.last else None,
        }


class LearnerServer:
    """The learner as a `Service`: the training loop plus gRPC WeightService, HTTP and a
    registry entry; `wait` trains to the last step and serves the final weights for
    `learner.linger_s` more."""

    def __init__(
        self, config: LearnerSettings, client: redis.Redis, trainer: Trainer | None = None
    ) -> None:
        self.config, self.client = config, client
        self.learner = Learner(config, client, open_weight_socket(config), trainer)
        self.grpc_server: grpc.Server | None = None
        self.grpc_port = 0
        self.http: HttpServer | None = None
        self.registration: Registration | None = None

    @property
    def ports(self) -> dict[str, int]:
        return {"grpc": self.grpc_port, "http": self.http.port if self.http else 0}

    def start(self) -> LearnerServer:
        server_cfg, config = self.config.learner.server, self.config
        self.grpc_server, self.grpc_port = start_grpc_server(
            server_cfg,
            lambda s: add_weight_service(self.learner.weights, s),
            ["dapo.v1.WeightService"],
            security=config.security,
            max_message_bytes=config.shared.rpc.max_message_bytes,
        )
        app = create_http_app("learner", status=self.learner.status, auth=config.security.auth)
        self.http = serve_http(app, server_cfg.host, server_cfg.http_port)
        self.registration = register(
            self.client, config, "learner", server_cfg.host, self.grpc_port
        )
        return self

    def wait(self, stop: threading.Event) -> None:
        self.learner.run(stop)
        if self.learner.step < self.config.learner.total_steps:  # stopped: not a success
            raise SystemExit(STOPPED_EXIT)  # a Job or `restart: on-failure` resumes it
        stop.wait(self.config.learner.linger_s)  # evaluation and late rollout servers

    def stop(self) -> None:
        if self.registration is not None:
            self.registration.stop()
        if self.grpc_server is not None:
            self.grpc_server.stop(grace=2).wait()
        self.learner.weights.close()
        if self.http is not None:
            self.http.stop()


def create_server(config: LearnerSettings, client: redis.Redis | None = None) -> LearnerServer:
    """The learner service (rank 0), not yet started."""
    return LearnerServer(config, client or connect_run(config))
