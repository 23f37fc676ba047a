"""Publication off the critical path (learner/publisher.py): a real Learner (torch policy)
trains on real Redis while its WeightService (real gRPC) serves a real rollout server that
syncs through the registry. Publishing a version is made slow (1 s) so that overlap is
observable, in both modes:
- the snapshot taken in the step (ZeRO-3's mode): step N+1 starts training before
  version N is served;
- the copy in the background too (every other engine): the step goes on (commits)
  before version N is copied, and step N+1 trains only once it is (its weights change).
Either way the rollout server loads every version, in order, with the learner's exact
weights.
"""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path

import pytest
import redis
import torch
from learner_fixtures import TORCH_FP32_STEP, fill_train, learner_config
from rollout_fixtures import make_config, serve, wait_for

from learner.publisher import BackgroundPublisher
from learner.server import Learner
from learner.weights import WeightServicer, add_weight_service
from services.common.grpc_server import start_grpc_server
from services.common.keys import RunKeys
from services.common.registry import Registration
from services.common.server_config import ServerConfig

STEPS, BATCH, PUBLISH_S = 3, 2, 1.0


class SlowServicer(WeightServicer):
    """The learner's WeightService, taking PUBLISH_S longer to publish a version."""

    def publish_snapshot(self, version, snapshot, tensors) -> None:
        time.sleep(PUBLISH_S)
        super().publish_snapshot(version, snapshot, tensors)

    def publish(self, version, tensors, total=None) -> None:
        time.sleep(PUBLISH_S)
        super().publish(version, tensors, total)


def _learner(model: Path, client: redis.Redis, run: str) -> Learner:
    sets = {**TORCH_FP32_STEP, "shared.train_batch_groups": BATCH, "learner.total_steps": STEPS}
    config = learner_config(model, run, sets)
    fill_train(client, run, BATCH * STEPS, seed=11)
    learner = Learner(config, client)
    learner.weights = SlowServicer(config.learner.publication.bucket_bytes)
    learner.publisher = BackgroundPublisher(learner.weights)
    return learner


@pytest.mark.parametrize("overlap", [False, True])
def test_the_step_goes_on_while_the_last_version_is_published(
    tiny_model: Path, redis_client: redis.Redis, overlap: bool
) -> None:
    run = f"bg-{uuid.uuid4().hex[:6]}"
    learner = _learner(tiny_model, redis_client, run)
    assert learner.policy.weight_copy_overlaps  # a torch policy's weights: any thread
    learner.policy.weight_copy_overlaps = overlap  # as a ZeRO-3 policy declares it (False)
    started: list[float] = []
    train = learner.trainer.train
    learner.trainer.train = lambda *a, **k: (started.append(time.monotonic()), train(*a, **k))[1]
    submitted: list[float] = []  # when `submit` returned, the step going on to its commit
    submit = learner.publisher.submit
    learner.publisher.submit = lambda *a, **k: (
        submit(*a, **k),
        submitted.append(time.monotonic()),
    )[0]  # type: ignore[method-assign]
    loaded: list[int] = []

    def recording(engine):
        load = engine.load_weights
        engine.load_weights = lambda named, version, **kw: (
            load(named, version, **kw),
            loaded.append(version),
        )
        return engine

    server, port = start_grpc_server(
        ServerConfig(), lambda s: add_weight_service(learner.weights, s), ["dapo.v1.WeightService"]
    )
    info = {"address": f"127.0.0.1:{port}"}
    registration = Registration(redis_client, RunKeys(run), "learner", "learner-0", info).start()
    try:
        with serve(tiny_model, make_config(run), redis_client, wrap=recording) as rollout:
            stop = threading.Event()
            for _ in range(STEPS):
                assert learner.fill_batch(stop)
                learner.train_once()
            learner.publisher.wait()
            served = dict(learner.publisher.finished)
            for version in range(1, STEPS):  # started[N]: step N+1; submitted[N-1]: step N
                if overlap:  # step N committed before N was copied; N+1 trained after
                    assert submitted[version - 1] < served[version] < started[version]
                else:  # step N+1 began before version N was served
                    assert started[version] < served[version]
            wait_for(lambda: rollout.engine.version == STEPS)
            assert loaded == list(range(1, STEPS + 1))  # every version, in order
            final = dict(rollout.engine.model.state_dict())
            for name, tensor in learner.policy.named_weights():
                assert torch.equal(final[name], tensor), name
    finally:
        registration.stop()
        server.stop(grace=0)
