"""The learner service: reads informative groups from `train`, trains, publishes weights.

Commit protocol for one step: train on N groups → snapshot the new weights into the
WeightService → in one Redis transaction set the version, ack the N entries, count them
as trained and append the step's metrics. Groups that arrive too stale are acked and
counted as `dropped:stale` in one transaction too, so the ledger always balances.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import uuid
from typing import Any

import redis
from prometheus_client import Counter, Gauge

from dapo.v1 import learner_pb2_grpc
from learner.policy import TorchPolicy, load_model
from learner.step import StepMetrics, train_step
from learner.weights import WeightServicer, snapshot
from services.common.adapters import decode_group
from services.common.config import DapoConfig
from services.common.errors import DapoError
from services.common.grpc_server import start_grpc_server
from services.common.http import HttpServer, create_http_app, serve_http
from services.common.keys import RunKeys
from services.common.registry import Registration
from services.common.streams import Entry, StreamConsumer
from services.common.types import Group

log = logging.getLogger(__name__)

STEP_GAUGES = {
    name: Gauge(f"dapo_learner_{name}", f"Last step's {name.replace('_', ' ')}")
    for name in StepMetrics().as_dict()
}
VERSION = Gauge("dapo_learner_policy_version", "Latest committed policy version")
STALENESS = Gauge("dapo_learner_batch_max_staleness", "Max staleness of the last batch")
GROUPS = Counter("dapo_learner_groups_total", "Groups consumed", ["outcome"])
CONSUMER_GROUP = "learner"


class Learner:
    """Owns the policy, the consumer on `train`, and the weight service."""

    def __init__(self, config: DapoConfig, client: redis.Redis) -> None:
        self.config, self.client = config, client
        self.keys = RunKeys(config.shared.run_name)
        model_path = config.model_path
        if model_path is None:
            raise DapoError("learner.model_path (or shared.model_path) is required")
        from pathlib import Path

        if not Path(model_path).is_dir():
            raise DapoError(f"model directory not found: {model_path}")
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.policy = TorchPolicy(load_model(model_path, config.learner.dtype), config.learner)
        self.version = int(client.get(self.keys.version) or 0)
        self.consumer = StreamConsumer(client, self.keys.train, CONSUMER_GROUP, "learner-0")
        self.weights = WeightServicer(config.learner.weight_bucket_bytes)
        self.weights.publish(self.version, snapshot(self.policy.named_weights()))
        self.last: StepMetrics | None = None
        self._batch: list[tuple[Entry, Group]] = []

    # --------------------------------------------------------------- consuming
    def _drop_stale(self, entry: Entry) -> None:
        pipe = self.client.pipeline(transaction=True)
        pipe.xack(self.keys.train, CONSUMER_GROUP, entry.id)
        pipe.hincrby(self.keys.ledger, "dropped:stale", 1)
        pipe.execute()
        GROUPS.labels("dropped_stale").inc()

    def take(self, entries: list[Entry]) -> None:
        """Add fresh groups to the batch being built; drop (and count) stale ones."""
        bound = self.config.shared.max_staleness
        for entry in entries:
            group = decode_group(entry.fields["group"])
            if self.version - group.min_policy_version > bound:
                self._drop_stale(entry)
            else:
                self._batch.append((entry, group))

    def fill_batch(self, stop: threading.Event) -> bool:
        """Block until train_batch_groups fresh groups are held (False if stopping)."""
        need = self.config.learner.train_batch_groups
        self.take(self.consumer.read_own_pending(need))
        while len(self._batch) < need:
            if stop.is_set():
                return False
            self.take(self.consumer.read(need - len(self._batch), block_ms=200))
        return True

    # --------------------------------------------------------------- training
    def train_once(self) -> StepMetrics:
        cfg, shared = self.config.learner, self.config.shared
        batch = self._batch[: cfg.train_batch_groups]
        groups = [g for _, g in batch]
        metrics = train_step(
            self.policy, groups, cfg, self.pad_id, self.config.rollout.sampling.temperature,
            shared.max_response_length, seed=shared.seed + self.version,
        )  # fmt: skip
        self.policy.advance_schedule()
        staleness = max(self.version - g.min_policy_version for g in groups)
        self.commit([e.id for e, _ in batch], metrics, staleness)
        self._batch = self._batch[cfg.train_batch_groups :]
        return metrics

    def commit(self, ids: list[str], metrics: StepMetrics, staleness: int) -> None:
        """Publish weights, then version + acks + ledger + metrics atomically."""
        new_version = self.version + 1
        self.weights.publish(new_version, snapshot(self.policy.named_weights()))
        record = dict(metrics.as_dict(), step=new_version, staleness=staleness)
        pipe = self.client.pipeline(transaction=True)
        pipe.set(self.keys.version, new_version)
        pipe.xack(self.keys.train, CONSUMER_GROUP, *ids)
        pipe.hincrby(self.keys.ledger, "trained", len(ids))
        pipe.xadd(self.keys.metrics, {"json": json.dumps(record)})
        pipe.execute()
        self.version, self.last = new_version, metrics
        for name, value in metrics.as_dict().items():
            STEP_GAUGES[name].set(value)
        VERSION.set(new_version)
        STALENESS.set(staleness)
        GROUPS.labels("trained").inc(len(ids))

    def run(self, stop: threading.Event) -> None:
        total = self.config.learner.total_steps
        while self.version < total and self.fill_batch(stop):
            m = self.train_once()
            log.info(
                "step=%d loss=%.4f acc=%.3f entropy=%.3f grad_norm=%.3f gap=%.2e %.2fs",
                self.version, m.loss, m.accuracy, m.entropy, m.grad_norm, m.logprob_gap,
                m.seconds,
            )  # fmt: skip
        if self.version >= total:
            self.client.set(self.keys.done, self.version)
            log.info("reached total_steps=%d; run done", total)

    def status(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "batch_held": len(self._batch),
            "last_step": self.last.as_dict() if self.last else None,
        }


class LearnerServer:
    """Learner + gRPC WeightService + HTTP + registry entry."""

    def __init__(self, config: DapoConfig, client: redis.Redis) -> None:
        self.learner = Learner(config, client)
        server_cfg = config.learner.server
        self.grpc_server, self.grpc_port = start_grpc_server(
            server_cfg,
            lambda s: learner_pb2_grpc.add_WeightServiceServicer_to_server(self.learner.weights, s),
            ["dapo.v1.WeightService"],
        )
        app = create_http_app("learner", status=self.learner.status)
        self.http: HttpServer = serve_http(app, server_cfg.host, server_cfg.http_port)
        host = socket.gethostname() if server_cfg.host == "0.0.0.0" else server_cfg.host
        self.registration = Registration(
            client, self.learner.keys, "learner", f"learner-{uuid.uuid4().hex[:8]}",
            {"address": f"{host}:{self.grpc_port}"},
        ).start()  # fmt: skip

    def stop(self) -> None:
        self.registration.stop()
        self.grpc_server.stop(grace=2).wait()
        self.http.stop()
