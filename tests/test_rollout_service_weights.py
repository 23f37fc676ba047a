"""Weights of a rollout server: updates through the updater the weight sync feeds
(serialized buckets, parsed as pulled ones are) and pulled from a real learner
WeightService; generation changes with them; bad or truncated updates leave the old
weights; `min_version` waits for (and pulls) the weights it names; a late joiner
catches up before it takes work.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis
import torch
from rollout_fixtures import (
    HTTP,
    PROMPT,
    SEEDED,
    frames,
    learner_weights,
    make_config,
    metric,
    perturbed,
    rollout_entry,
    serve,
    wait_for,
)

from dapo.v1 import rollout_pb2
from rollout.torch_engine import TorchEngine
from services.common.keys import RunKeys
from services.common.registry import discover
from services.weight_transport.tensor_codec import RawTensor, parse_bucket
from services.weight_transport.torch_codec import from_torch


def test_update_changes_generation_and_moves_version_forward(tiny_model: Path) -> None:
    with serve(tiny_model, make_config()) as s:
        before = s.fingerprint()
        assert s.load(frames(perturbed(s.engine), version=3)) == 3
        after = s.fingerprint()
        assert after != before
        assert all(c.policy_version == 3 for c in s.generate(n=2))
        with pytest.raises(ValueError, match="not newer"):
            s.load(frames(perturbed(s.engine, seed=1), version=2))
        assert s.engine.version == 3 and s.fingerprint() == after
        assert metric(s, "dapo_rollout_policy_version") == 3
        assert metric(s, "dapo_rollout_weight_update_seconds_count") == 1
        assert metric(s, "dapo_rollout_weight_update_failures_total") == 1


def _at_least(version: int, n: int = 2) -> rollout_pb2.GenerateRequest:
    return rollout_pb2.GenerateRequest(
        request_id="v", prompt_token_ids=PROMPT, n=n, sampling=SEEDED, min_version=version
    )


def test_min_version_waits_for_the_weights_it_names(tiny_model: Path) -> None:
    with serve(tiny_model, make_config(min_version_wait_s=30.0)) as s:
        out: list[Any] = []
        waiter = threading.Thread(
            target=lambda: out.extend(s.stub.GenerateGroup(_at_least(1), timeout=60).completions),
            daemon=True,
        )
        waiter.start()
        wait_for(lambda: s.server.servicer.in_flight == 1)  # admitted, waiting at version 0
        assert s.load(frames(perturbed(s.engine), version=1)) == 1
        waiter.join(30)
        # Generated at version 1 only: without the wait it would have finished at version 0.
        assert [c.policy_version for c in out] == [1, 1]
        assert s.server.servicer.in_flight == 0


def test_min_version_out_of_reach_is_unavailable_and_releases_the_slot(
    tiny_model: Path,
) -> None:
    with serve(tiny_model, make_config(min_version_wait_s=0.2)) as s:
        with pytest.raises(grpc.RpcError) as err:
            s.stub.GenerateGroup(_at_least(5), timeout=30)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "needs >= 5" in (err.value.details() or "")
        assert s.server.servicer.in_flight == 0
        assert [c.policy_version for c in s.generate(n=1)] == [0]  # version 0 still serves


def test_min_version_pulls_at_once_instead_of_at_the_next_poll(
    tiny_model: Path, redis_client: redis.Redis
) -> None:
    keys = RunKeys(f"minv-{uuid.uuid4().hex[:6]}")
    redis_client.set(keys.version, 1)
    # A poll this slow would never fetch version 2 within min_version_wait_s.
    config = make_config(keys.run, weight_poll_s=600.0, min_version_wait_s=30.0)
    with learner_weights(redis_client, keys) as (learner, register):
        learner.publish(1, perturbed(TorchEngine(tiny_model, device="cpu"), seed=1))
        register()
        with serve(tiny_model, config, redis_client) as s:
            wait_for(lambda: s.engine.version == 1)  # the first sync runs at start
            learner.publish(2, perturbed(s.engine, seed=2))
            redis_client.set(keys.version, 2)
            group = s.stub.GenerateGroup(_at_least(2), timeout=60)
            assert [c.policy_version for c in group.completions] == [2, 2]


def _renamed(t: RawTensor) -> RawTensor:
    return RawTensor("model.no_such.weight", t.dtype, t.shape, t.data)


def _as_float64(t: RawTensor) -> RawTensor:
    return from_torch(t.name, torch.zeros(t.shape, dtype=torch.float64))


def _reshaped(t: RawTensor) -> RawTensor:
    return from_torch(t.name, torch.zeros((1, *t.shape)))


@pytest.mark.parametrize(
    ("spoil", "needle"),
    [(_renamed, "model.no_such.weight"), (_as_float64, "dtype"), (_reshaped, "shape")],
    ids=["name", "dtype", "shape"],
)
def test_bad_bucket_is_rejected_and_old_weights_kept(
    tiny_model: Path, spoil: Callable[[RawTensor], RawTensor], needle: str
) -> None:
    with serve(tiny_model, make_config()) as s:
        before = s.fingerprint()
        tensors = perturbed(s.engine)
        tensors[-1] = spoil(tensors[-1])  # every other tensor is fine and must not land
        with pytest.raises(ValueError, match=needle):
            s.load(frames(tensors, version=1))
        assert s.engine.version == 0 and s.fingerprint() == before
        assert s.readyz() == 200


def test_truncated_update_is_never_applied(tiny_model: Path) -> None:
    with serve(tiny_model, make_config()) as s:
        before = s.fingerprint()
        update = frames(perturbed(s.engine), version=1)
        assert len(update) > 2 and parse_bucket(update[-1]).last
        with pytest.raises(ValueError, match="incomplete"):
            s.load(update[:-1])  # the stream ends without `last`
        assert s.engine.version == 0 and s.fingerprint() == before
        assert s.load(update) == 1  # the whole update still goes in afterwards


def test_late_joiner_catches_up_and_readyz_flips(
    tiny_model: Path, redis_client: redis.Redis
) -> None:
    keys = RunKeys(f"catchup-{uuid.uuid4().hex[:6]}")
    redis_client.set(keys.version, 1)  # the learner is already at version 1
    config = make_config(keys.run)
    with (
        serve(tiny_model, config, redis_client) as s,
        learner_weights(redis_client, keys) as (
            learner,
            register,
        ),
    ):
        # No learner to fetch from yet: not ready anywhere, and no work is taken.
        entry = rollout_entry(redis_client, keys)
        assert s.readyz() == 503 and not entry["ready"] and not entry["accepting"]
        ttl_ms = redis_client.pttl(f"{keys.registry('rollout')}:{entry['instance']}")
        assert 0 < ttl_ms <= 2000  # heartbeat TTL from shared.registry_ttl_s
        with pytest.raises(grpc.RpcError) as err:
            s.generate()
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "catching up" in (err.value.details() or "")

        v1 = perturbed(s.engine, seed=1)
        learner.publish(1, v1)
        register()
        wait_for(lambda: s.readyz() == 200)
        wait_for(lambda: rollout_entry(redis_client, keys)["ready"])
        assert rollout_entry(redis_client, keys)["accepting"]
        assert s.engine.version == 1 and rollout_entry(redis_client, keys)["version"] == 1
        loaded = dict(s.engine.model.named_parameters())
        for raw in v1:  # the pulled weights are exactly the learner's
            assert torch.equal(
                loaded[raw.name].detach(),
                torch.frombuffer(bytearray(raw.data), dtype=torch.float32).reshape(raw.shape),
            )
        at_v1 = s.fingerprint()

        # The learner commits version 2 before its snapshot can be fetched: a server that
        # has caught up once stays ready and keeps serving (samples say version 1); being
        # behind is the staleness gate's business, and /status says it.
        redis_client.set(keys.version, 2)
        wait_for(lambda: HTTP.get(f"{s.url}/status").json()["published_version"] == 2)
        assert s.readyz() == 200 and rollout_entry(redis_client, keys)["ready"]
        assert rollout_entry(redis_client, keys)["accepting"]  # the controller still routes here
        status = HTTP.get(f"{s.url}/status").json()
        assert status["accepting"] and status["ready"] and status["version"] == 1
        assert [c.policy_version for c in s.generate(n=2)] == [1, 1]
        learner.publish(2, perturbed(s.engine, seed=2))
        wait_for(lambda: s.engine.version == 2)
        assert s.readyz() == 200 and s.fingerprint() != at_v1
    assert discover(redis_client, keys, "rollout") == []  # stop() deregisters


class SlowLoads:
    """An engine whose every weight load takes `delay_s` (a large model's update)."""

    def __init__(self, inner: TorchEngine, delay_s: float = 0.6) -> None:
        self.inner, self.delay_s, self.loading = inner, delay_s, threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    @property
    def version(self) -> int:
        return self.inner.version

    def load_weights(self, named: Any, version: int, owned: bool = False) -> None:
        self.loading.set()
        time.sleep(self.delay_s)
        self.inner.load_weights(named, version, owned=owned)
        self.loading.clear()


def test_readiness_never_flips_while_slow_updates_load(
    tiny_model: Path, redis_client: redis.Redis
) -> None:
    """Readiness is "can serve" (docs/deploy.md): a server that caught up once stays ready
    through every later publication, however long the update takes, so the kubelet never
    takes it out of the Service or the relay chain's DNS on a weight update."""
    keys = RunKeys(f"slow-{uuid.uuid4().hex[:6]}")
    redis_client.set(keys.version, 1)
    with (
        learner_weights(redis_client, keys) as (learner, register),
        serve(tiny_model, make_config(keys.run), redis_client, wrap=SlowLoads) as s,
    ):
        learner.publish(1, perturbed(s.engine.inner, seed=1))
        register()
        wait_for(lambda: s.readyz() == 200 and rollout_entry(redis_client, keys)["ready"])
        seen: list[tuple[int, bool, int]] = []
        for version in (2, 3, 4):
            learner.publish(version, perturbed(s.engine.inner, seed=version))
            redis_client.set(keys.version, version)
            while s.engine.version < version:
                entry = rollout_entry(redis_client, keys)
                seen.append((s.readyz(), entry["ready"], s.engine.version))
                time.sleep(0.02)
        loading = [v for _, _, v in seen]
        assert len(seen) >= 3 * 10 and set(loading) >= {1, 2, 3}  # polled through each load
        assert {(code, ready) for code, ready, _ in seen} == {(200, True)}, seen
        assert [c.policy_version for c in s.generate(n=1)] == [4]
