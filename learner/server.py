"""The learner service: reads informative groups from `train`, trains, publishes weights.

One step trains N groups (held by `learner.train_stream`), snapshots the new weights
into the WeightService and commits the version and metrics in one Redis transaction; the
entries are acked then or, with checkpoints, once a checkpoint holds their effect
(`learner.checkpoints`). With several ranks, rank 0 runs all this and commands the others
(`learner.trainer`). Acks, restarts and why versions never go backwards:
docs/architecture.md, "The learner: ack at checkpoint, dedup by the checkpointed cursor".
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import redis
from prometheus_client import Counter, Gauge

from learner.checkpoints import Checkpointer
from learner.config import LearnerSettings
from learner.publisher import BackgroundPublisher
from learner.step import StepMetrics
from learner.train_stream import TrainStream, stream_id
from learner.trainer import Commander, Trainer, any_rank_stopping
from learner.weights import WeightServicer, add_weight_service, open_weight_socket, stream_views
from services.common.eval_hold import HoldWaiter
from services.common.grpc_server import start_grpc_server
from services.common.http import HttpServer, create_http_app, serve_http
from services.common.keys import RunKeys
from services.common.redis_server import connect_run
from services.common.registry import Registration
from services.common.service import register
from services.common.staleness import staleness
from services.weight_transport.tensor_codec import RawTensor
from services.weight_transport.weight_socket import WeightSocketServer

log = logging.getLogger(__name__)

STEP_GAUGES = {
    name: Gauge(f"dapo_learner_{name}", f"Last step's {name.replace('_', ' ')}")
    for name in StepMetrics().as_dict()
}
VERSION = Gauge("dapo_learner_policy_version", "Latest committed policy version")
STALENESS = Gauge("dapo_learner_batch_max_staleness", "Max staleness of the last batch")
STALE_TRAINED = Counter(
    "dapo_learner_stale_groups_trained_total",
    "Groups trained past the soft staleness bound (within the hard one, corrected)",
)
SHORT_STEPS = Counter(
    "dapo_learner_short_steps_total",
    "Steps trained on fewer than train_batch_groups groups (learner.generation_budget spent)",
)
EVAL_HOLD = Counter(
    "dapo_learner_eval_hold_seconds_total",
    "Seconds the learner waited for eval points (controller.eval.hold_learner)",
)
STOPPED_EXIT = 143  # stopped before total_steps (128 + SIGTERM): a supervisor restarts it


class Learner:
    """Rank 0: trains what `stream` holds, publishes and commits each step, checkpoints
    (`checkpoints`) and tells the other ranks (`ranks`) to do the same."""

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
        self.ranks = Commander(self.trainer.dp)
        self.stream = TrainStream(config, client)
        self.weights = WeightServicer(config.learner.publication.bucket_bytes, weight_socket)
        self.publisher = BackgroundPublisher(self.weights)  # off the step's critical path
        self.checkpoints = Checkpointer(config, self.trainer, self.ranks, self.stream)
        self.eval_hold = HoldWaiter(client, self.keys)
        self.step, self.version, self.cursor = 0, 0, "0-0"
        self.last: StepMetrics | None = None
        self._stop = threading.Event()  # `run`'s: a signal, or any rank's after a step
        self._restore()

    def _restore(self) -> None:
        """Checkpoint state, then a version newer than anything rollout servers hold.
        Once the run has a version, restore even without `resume` (compose and Kubernetes
        restart the learner with the same command: never publish the base model anew)."""
        published = int(self.client.get(self.keys.version) or 0)
        run_id = self.client.get(self.keys.run_id)
        self.checkpoints.run_id = run_id.decode() if run_id is not None else None
        resume = self.config.learner.checkpoint.resume or published > 0
        self.ranks.resume(resume)
        state = self.checkpoints.restore(resume)
        if state is not None:
            self.step, self.version = int(state["step"]), int(state["version"])
            self.cursor = str(state["cursor"])
            log.info("resumed step=%d version=%d cursor=%s", self.step, self.version, self.cursor)
        if published > self.version:  # a lost learner got further: its weights are gone
            self.version = published + 1
        self.weights.publish(self.version, *self._weights())
        if self.version != published:  # rollout servers load it before they are ready
            self.client.set(self.keys.version, self.version)
        VERSION.set(self.version)

    def _weights(self) -> tuple[Iterator[RawTensor], int]:
        """The policy's weights as `publish` streams them (gathered bucket by bucket)."""
        return stream_views(self.policy.named_weights()), self.policy.weight_count()

    def fill_batch(self, stop: threading.Event) -> bool:
        """Block until train_batch_groups fresh groups are held, or fewer once the
        generation budget is spent (False if stopping)."""
        return self.stream.fill(stop, self.version, self.cursor)

    def train_once(self) -> StepMetrics:
        need = self.config.shared.train_batch_groups
        batch = self.stream.next_batch()
        groups = [g for _, g in batch]
        seed = self.config.shared.seed + self.step
        self.publisher.settle()  # the last version's weights are copied: they may change
        self.ranks.train(seed, self.version, groups)
        self.checkpoints.poll()  # a background checkpoint written on every rank: ack it
        metrics = self.trainer.train(groups, seed, self.version)
        if any_rank_stopping(self.trainer.dp, self._stop):  # before commit's collectives
            log.info("stop requested: checkpointing after this step")
            self._stop_seen()
        lag = max(staleness(g, self.version) for g in groups)
        beyond = sum(self.stream.verdict(g, self.version) == "stale_trained" for g in groups)
        STALE_TRAINED.inc(beyond)
        if len(groups) < need:
            SHORT_STEPS.inc()
            log.info(
                "step %d trains %d of %d groups: %d generated since the last batch spent the "
                "generation budget",
                self.step + 1,
                len(groups),
                need,
                self.stream.generated,
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
        if self.config.learner.publication.in_background:
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
            generated=self.stream.generated,
        )
        trace = {"step": step, "version": new_version, "groups": group_ids, "entries": ids}
        ack = not self.checkpoints.enabled
        self.stream.commit(new_version, ids, json.dumps(record), json.dumps(trace), ack)
        self.step, self.version, self.last = self.step + 1, new_version, metrics
        self.cursor = max([self.cursor, *ids], key=stream_id)
        self.checkpoints.hold(ids)
        self._observe(metrics, staleness)
        if self.checkpoints.due(self.step):
            self.checkpoint()

    def _observe(self, metrics: StepMetrics, staleness: int) -> None:
        for name, value in metrics.as_dict().items():
            STEP_GAUGES[name].set(value)
        VERSION.set(self.version)
        STALENESS.set(staleness)

    def checkpoint(self, final: bool = False) -> None:
        """Checkpoint (`final`: and wait for it), then ack the entries it holds."""
        self.checkpoints.checkpoint(self.step, self.version, self.cursor, final)

    def wait_for_eval(self, stop: threading.Event) -> None:
        """Pause before the next step while the eval curve evaluates this version, when
        the controller asks (controller.eval.hold_learner; services/common/eval_hold.py)."""
        if self.step >= self.config.learner.total_steps:
            return  # the last version: `dapo up` evaluates it after the run
        held = self.eval_hold.wait(self.version, stop)
        if held > 0:
            EVAL_HOLD.inc(held)
            log.info("waited %.2fs for the eval point of version %d", held, self.version)

    def _stop_seen(self) -> None:
        if self.checkpoints.stop_seen is None:  # the stop checkpoint's budget starts here
            self.checkpoints.stop_seen = time.monotonic()

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
                self.wait_for_eval(stop)
            if stop.is_set():
                self._stop_seen()
            self.publisher.wait()  # the last version is served before the run ends
            self.checkpoint(final=True)  # also waits for a background one
            if self.step >= total:
                self.ranks.export()
                self.trainer.export()
                self.client.set(self.keys.done, self.version)
                log.info("reached total_steps=%d; run done", total)
            code = 0 if self.step >= total else STOPPED_EXIT
        finally:
            self.ranks.stop(code)
            if code != 1:  # every rank got here: close the group together
                self.trainer.dp.close()

    def status(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "step": self.step,
            "cursor": self.cursor,
            "unacked": self.checkpoints.not_acked,
            "batch_held": len(self.stream.held),
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
