"""The rollout service over real gRPC, HTTP and Redis with the torch engine on the tiny model.

Weights change through the service (pushed, and pulled from a real learner WeightService)
and generation changes with them; bad or truncated updates leave the old weights; each
limit gives INVALID_ARGUMENT naming it; concurrent calls share engine calls; samples
stream one by one; Pause drains; a late joiner catches up before it takes work.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import redis
import torch

from dapo.v1 import learner_pb2_grpc, rollout_pb2, rollout_pb2_grpc
from learner.weights import WeightServicer
from rollout.server import RolloutServer
from rollout.torch_engine import TorchEngine
from services.common.config import DapoConfig
from services.common.grpc_server import insecure_channel, start_grpc_server
from services.common.keys import RunKeys
from services.common.registry import Registration, discover
from services.common.server_config import ServerConfig
from services.common.tensor_codec import RawTensor, encode_buckets, from_torch

MAX_N, MAX_PROMPT, MAX_RESPONSE, MAX_REQUEST_BYTES = 4, 12, 8, 2048
PROMPT = [3, 5, 7, 9]
SEEDED = rollout_pb2.SamplingParams(temperature=1.0, max_tokens=6, seed=5)


def make_config(run: str = "svc", **rollout: Any) -> DapoConfig:
    return DapoConfig.model_validate(
        {
            "shared": {
                "run_name": run, "max_prompt_length": MAX_PROMPT,
                "max_response_length": MAX_RESPONSE, "group_size": 2,
            },
            "rollout": {
                "server": {"grpc_port": 0, "http_port": 0}, "max_n": MAX_N,
                "max_request_bytes": MAX_REQUEST_BYTES, "weight_poll_s": 0.05,
                "registry_ttl_s": 2.0, "drain_timeout_s": 20.0, **rollout,
            },
        }
    )  # fmt: skip


class Served:
    """A running RolloutServer plus a stub and an HTTP client for it."""

    def __init__(self, server: RolloutServer) -> None:
        self.server, self.engine = server, server.engine
        self.channel = insecure_channel(f"127.0.0.1:{server.grpc_port}")
        self.stub = rollout_pb2_grpc.RolloutServiceStub(self.channel)
        self.url = f"http://127.0.0.1:{server.http.port}"

    def generate(self, n: int = 1, prompt: list[int] = PROMPT, **sampling: Any) -> list[Any]:
        """Completions in sample order."""
        params = rollout_pb2.SamplingParams(**sampling) if sampling else SEEDED
        request = rollout_pb2.GenerateRequest(
            request_id="r", prompt_token_ids=prompt, n=n, sampling=params
        )
        responses = list(self.stub.Generate(request, timeout=60))
        assert sorted(r.sample_index for r in responses) == list(range(n))
        return [r.completion for r in sorted(responses, key=lambda r: r.sample_index)]

    def fingerprint(self) -> list[tuple[list[int], list[float]]]:
        """A seeded generation: equal iff the weights are equal."""
        return [(list(c.token_ids), [round(x, 4) for x in c.logprobs]) for c in self.generate(n=2)]

    def readyz(self) -> int:
        return httpx.get(f"{self.url}/readyz", timeout=5).status_code

    def push(self, buckets: Iterator[Any]) -> rollout_pb2.UpdateWeightsResponse:
        return self.stub.UpdateWeights(buckets, timeout=60)


@contextmanager
def serve(
    model: Path, config: DapoConfig, client: redis.Redis | None = None, wrap: Callable = lambda e: e
) -> Iterator[Served]:
    engine = wrap(TorchEngine(model, device="cpu", max_batch_size=8))
    server = RolloutServer(config, client, engine).start()
    served = Served(server)
    try:
        yield served
    finally:
        served.channel.close()
        server.stop()


def perturbed(engine: TorchEngine, scale: float = 0.5, seed: int = 0) -> list[RawTensor]:
    """All parameters plus noise: same names, shapes, dtypes; another policy."""
    gen = torch.Generator().manual_seed(seed)
    return [
        from_torch(name, p.detach() + scale * torch.randn(p.shape, generator=gen))
        for name, p in engine.model.named_parameters()
    ]


def wait_for(condition: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def metric(served: Served, name: str) -> float:
    """The value of one unlabelled sample in /metrics."""
    for line in httpx.get(f"{served.url}/metrics", timeout=5).text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


# -- generation ------------------------------------------------------------------------


def test_generate_returns_n_tagged_samples_and_counts_them(tiny_model: Path) -> None:
    with serve(tiny_model, make_config()) as s:
        text_request = rollout_pb2.GenerateRequest(request_id="g1", prompt="1+2=", n=3)
        responses = list(s.stub.Generate(text_request, timeout=60))
        assert sorted(r.sample_index for r in responses) == [0, 1, 2]
        expected_prompt = s.engine.tokenizer.encode("1+2=", add_special_tokens=False)
        tokens = 0
        for r in responses:
            c = r.completion
            assert r.request_id == "g1" and list(r.prompt_token_ids) == expected_prompt
            assert 1 <= len(c.token_ids) == len(c.logprobs) <= MAX_RESPONSE
            assert c.policy_version == 0 and all(lp <= 0 for lp in c.logprobs)
            assert c.finish_reason in (
                rollout_pb2.FINISH_REASON_STOP,
                rollout_pb2.FINISH_REASON_LENGTH,
            )
            tokens += len(c.token_ids)
        assert metric(s, "dapo_rollout_tokens_generated_total") == tokens
        assert metric(s, "dapo_rollout_tokens_per_second") > 0
        assert metric(s, "dapo_rollout_requests_in_flight") == 0
        assert metric(s, "dapo_rollout_queue_depth") == 0
        assert s.fingerprint() == s.fingerprint()  # seeded: reproducible through the service


# -- weights ---------------------------------------------------------------------------


def test_pushed_update_changes_generation_and_moves_version_forward(tiny_model: Path) -> None:
    with serve(tiny_model, make_config()) as s:
        before = s.fingerprint()
        reply = s.push(encode_buckets(perturbed(s.engine), version=3, bucket_bytes=4096))
        assert reply.applied and reply.version == 3 and not reply.error
        after = s.fingerprint()
        assert after != before
        assert all(c.policy_version == 3 for c in s.generate(n=2))
        stale = s.push(encode_buckets(perturbed(s.engine, seed=1), version=2, bucket_bytes=4096))
        assert not stale.applied and "not newer" in stale.error and stale.version == 3
        assert s.fingerprint() == after
        assert metric(s, "dapo_rollout_policy_version") == 3
        assert metric(s, "dapo_rollout_weight_update_seconds_count") == 1
        assert metric(s, "dapo_rollout_weight_update_failures_total") == 1


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
        reply = s.push(encode_buckets(tensors, version=1, bucket_bytes=4096))
        assert not reply.applied and needle in reply.error and reply.version == 0
        assert s.engine.version == 0 and s.fingerprint() == before
        assert s.readyz() == 200


def test_truncated_update_is_never_applied(tiny_model: Path) -> None:
    with serve(tiny_model, make_config()) as s:
        before = s.fingerprint()
        buckets = list(encode_buckets(perturbed(s.engine), version=1, bucket_bytes=4096))
        assert len(buckets) > 2 and buckets[-1].last
        reply = s.push(iter(buckets[:-1]))  # the stream ends without `last`
        assert not reply.applied and "incomplete" in reply.error
        assert s.engine.version == 0 and s.fingerprint() == before
        assert s.push(iter(buckets)).applied  # the whole update still goes in afterwards


# -- catch-up from the learner ---------------------------------------------------------


@contextmanager
def learner_weights(
    client: redis.Redis, keys: RunKeys
) -> Iterator[tuple[WeightServicer, Callable[[], None]]]:
    """A real learner WeightService on a free port, and a function that registers it."""
    servicer = WeightServicer(bucket_bytes=8192)
    server, port = start_grpc_server(
        ServerConfig(),
        lambda s: learner_pb2_grpc.add_WeightServiceServicer_to_server(servicer, s),
        ["dapo.v1.WeightService"],
    )
    info = {"address": f"127.0.0.1:{port}"}
    registration = Registration(client, keys, "learner", "learner-0", info)
    try:
        yield servicer, registration.start
    finally:
        registration.stop()
        server.stop(grace=0)


def rollout_entry(client: redis.Redis, keys: RunKeys) -> dict[str, Any]:
    (entry,) = discover(client, keys, "rollout")
    return entry


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
        assert s.readyz() == 503 and not entry["ready"]
        ttl_ms = redis_client.pttl(f"{keys.registry('rollout')}:{entry['instance']}")
        assert 0 < ttl_ms <= 2000  # heartbeat TTL from rollout.registry_ttl_s
        with pytest.raises(grpc.RpcError) as err:
            s.generate()
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "catching up" in (err.value.details() or "")

        v1 = perturbed(s.engine, seed=1)
        learner.publish(1, v1)
        register()
        wait_for(lambda: s.readyz() == 200)
        wait_for(lambda: rollout_entry(redis_client, keys)["ready"])
        assert s.engine.version == 1 and rollout_entry(redis_client, keys)["version"] == 1
        loaded = dict(s.engine.model.named_parameters())
        for raw in v1:  # the pulled weights are exactly the learner's
            assert torch.equal(loaded[raw.name].detach(), torch.frombuffer(bytearray(raw.data),
                               dtype=torch.float32).reshape(raw.shape))  # fmt: skip
        at_v1 = s.fingerprint()

        # The learner commits version 2 before its snapshot can be fetched: 503 meanwhile,
        # but a server that has caught up once keeps serving (samples say version 1).
        redis_client.set(keys.version, 2)
        wait_for(lambda: s.readyz() == 503)
        wait_for(lambda: not rollout_entry(redis_client, keys)["ready"])
        assert [c.policy_version for c in s.generate(n=2)] == [1, 1]
        learner.publish(2, perturbed(s.engine, seed=2))
        wait_for(lambda: s.readyz() == 200)
        assert s.engine.version == 2 and s.fingerprint() != at_v1
    assert discover(redis_client, keys, "rollout") == []  # stop() deregisters
