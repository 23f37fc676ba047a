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

from dapo.v1 import rollout_pb2, rollout_pb2_grpc
from learner.weights import WeightServicer, add_weight_service
from rollout.server import RolloutServer
from rollout.torch_engine import TorchEngine
from services.common.grpc_server import insecure_channel, start_grpc_server
from services.common.keys import RunKeys
from services.common.registry import Registration, discover
from services.common.server_config import ServerConfig
from services.common.tensor_codec import RawTensor, encode_buckets, from_torch
from services.tools.config import DapoConfig

MAX_N, MAX_PROMPT, MAX_RESPONSE, MAX_REQUEST_BYTES = 4, 12, 8, 2048
PROMPT = [3, 5, 7, 9]
SEEDED = rollout_pb2.SamplingParams(temperature=1.0, max_tokens=4, seed=5)
HTTP = httpx.Client(timeout=5)


def make_config(run: str = "svc", **rollout: Any) -> DapoConfig:
    return DapoConfig.model_validate(
        {
            "shared": {
                "run_name": run, "max_prompt_length": MAX_PROMPT,
                "max_response_length": MAX_RESPONSE, "group_size": 2,
                "registry_ttl_s": 2.0,
            },
            "rollout": {
                "server": {"grpc_port": 0, "http_port": 0}, "max_n": MAX_N,
                "max_request_bytes": MAX_REQUEST_BYTES, "weight_poll_s": 0.05,
                "drain_timeout_s": 20.0, **rollout,
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
        return [(list(c.token_ids), [round(x, 4) for x in c.logprobs]) for c in self.generate(n=1)]

    def readyz(self) -> int:
        return HTTP.get(f"{self.url}/readyz").status_code

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
    for line in HTTP.get(f"{served.url}/metrics").text.splitlines():
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


def _at_least(version: int, n: int = 2) -> rollout_pb2.GenerateRequest:
    return rollout_pb2.GenerateRequest(
        request_id="v", prompt_token_ids=PROMPT, n=n, sampling=SEEDED, min_version=version
    )


def test_generate_group_answers_all_n_in_one_message_like_generate(tiny_model: Path) -> None:
    with serve(tiny_model, make_config()) as s:
        request = _at_least(0, n=3)
        group = s.stub.GenerateGroup(request, timeout=60)
        streamed = sorted(s.stub.Generate(request, timeout=60), key=lambda r: r.sample_index)
        assert group.request_id == "v" and list(group.prompt_token_ids) == PROMPT
        # Seeded: the same samples as the streamed call, in sample-index order.
        assert [list(c.token_ids) for c in group.completions] == [
            list(r.completion.token_ids) for r in streamed
        ]
        with pytest.raises(grpc.RpcError) as err:  # the same limits as Generate
            s.stub.GenerateGroup(_at_least(0, n=MAX_N + 1), timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert s.server.servicer.in_flight == 0


def test_min_version_waits_for_the_weights_it_names(tiny_model: Path) -> None:
    with serve(tiny_model, make_config(min_version_wait_s=30.0)) as s:
        out: list[Any] = []
        waiter = threading.Thread(
            target=lambda: out.extend(s.stub.Generate(_at_least(1), timeout=60)), daemon=True
        )
        waiter.start()
        wait_for(lambda: s.server.servicer.in_flight == 1)  # admitted, waiting at version 0
        assert s.push(encode_buckets(perturbed(s.engine), version=1, bucket_bytes=4096)).applied
        waiter.join(30)
        # Generated at version 1 only: without the wait it would have finished at version 0.
        assert [r.completion.policy_version for r in out] == [1, 1]
        assert s.server.servicer.in_flight == 0


def test_min_version_out_of_reach_is_unavailable_and_releases_the_slot(
    tiny_model: Path,
) -> None:
    with serve(tiny_model, make_config(min_version_wait_s=0.2)) as s:
        with pytest.raises(grpc.RpcError) as err:
            list(s.stub.Generate(_at_least(5), timeout=30))
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
            responses = list(s.stub.Generate(_at_least(2), timeout=60))
            assert [r.completion.policy_version for r in responses] == [2, 2]


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
        lambda s: add_weight_service(servicer, s),  # the learner's own registration
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
            assert torch.equal(loaded[raw.name].detach(), torch.frombuffer(bytearray(raw.data),
                               dtype=torch.float32).reshape(raw.shape))  # fmt: skip
        at_v1 = s.fingerprint()

        # The learner commits version 2 before its snapshot can be fetched: 503 meanwhile,
        # but a server that has caught up once keeps serving (samples say version 1).
        redis_client.set(keys.version, 2)
        wait_for(lambda: s.readyz() == 503)
        wait_for(lambda: not rollout_entry(redis_client, keys)["ready"])
        assert rollout_entry(redis_client, keys)["accepting"]  # the controller still routes here
        status = HTTP.get(f"{s.url}/status").json()
        assert status["accepting"] and not status["ready"] and status["published_version"] == 2
        assert [c.policy_version for c in s.generate(n=2)] == [1, 1]
        learner.publish(2, perturbed(s.engine, seed=2))
        wait_for(lambda: s.readyz() == 200)
        assert s.engine.version == 2 and s.fingerprint() != at_v1
    assert discover(redis_client, keys, "rollout") == []  # stop() deregisters


# -- limits ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def limited(tiny_model: Path) -> Iterator[Served]:
    config = make_config()
    config.shared.rpc.max_message_bytes = 64 * 1024
    with serve(tiny_model, config) as s:
        yield s


def _request(n: int = 1, prompt: str = "", ids: tuple[int, ...] = (3, 4), **sampling: Any):
    return rollout_pb2.GenerateRequest(
        prompt=prompt, prompt_token_ids=[] if prompt else list(ids), n=n,
        sampling=rollout_pb2.SamplingParams(**{"max_tokens": 2, **sampling}),
    )  # fmt: skip


INVALID = grpc.StatusCode.INVALID_ARGUMENT
LIMIT_CASES = {
    "n_zero": (_request(n=0), INVALID, "rollout.max_n=4"),
    "n_too_many": (_request(n=MAX_N + 1), INVALID, "rollout.max_n=4"),
    "prompt_ids_too_long": (
        _request(ids=(3,) * (MAX_PROMPT + 1)), INVALID, "shared.max_prompt_length=12"
    ),
    "prompt_text_too_long": (_request(prompt="12+34=" * 8), INVALID, "shared.max_prompt_length"),
    "max_tokens": (
        _request(max_tokens=MAX_RESPONSE + 1), INVALID, "shared.max_response_length=8"
    ),
    "request_bytes": (_request(prompt="7" * 3000), INVALID, "rollout.max_request_bytes=2048"),
    "token_outside_vocab": (_request(ids=(3, 999)), INVALID, "vocabulary"),
    "empty_prompt": (_request(ids=()), INVALID, "empty"),
    "top_p": (_request(top_p=1.5), INVALID, "top_p"),
    "temperature": (_request(temperature=-1.0), INVALID, "temperature"),
    "past_max_message_bytes": (
        _request(prompt="7" * 70_000), grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max"
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", LIMIT_CASES)
def test_limit_violation_names_the_limit(limited: Served, case: str) -> None:
    request, code, needle = LIMIT_CASES[case]
    with pytest.raises(grpc.RpcError) as err:
        list(limited.stub.Generate(request, timeout=30))
    assert err.value.code() == code
    assert needle in (err.value.details() or "")


def test_server_keeps_serving_after_bad_requests(limited: Served) -> None:
    for request, _, _ in LIMIT_CASES.values():
        with pytest.raises(grpc.RpcError):
            list(limited.stub.Generate(request, timeout=30))
    assert len(limited.generate(n=MAX_N)) == MAX_N
    assert limited.readyz() == 200


# -- batching, streaming, pause --------------------------------------------------------


class Recording:
    """An engine wrapper that records each engine call and can hold one after its first
    sample (until `gate` is set) to show that samples reach the client before the rest."""

    def __init__(self, inner: TorchEngine) -> None:
        self.inner = inner
        self.calls: list[int] = []  # prompts per engine call
        self.gate: threading.Event | None = None
        self.gate_timed_out = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    @property
    def version(self) -> int:
        return self.inner.version

    def stream(self, prompts: Any, params: Any) -> Iterator[Any]:
        self.calls.append(len(prompts))
        return self._gated(self.inner.stream(prompts, params))

    def _gated(self, samples: Iterator[Any]) -> Iterator[Any]:
        for k, sample in enumerate(samples):
            yield sample
            if k == 0 and self.gate is not None and not self.gate.wait(10):
                self.gate_timed_out = True


def test_concurrent_calls_are_batched_and_each_gets_its_n(tiny_model: Path) -> None:
    with serve(tiny_model, make_config(), wrap=Recording) as s:
        batcher, results = s.server.servicer.batcher, {}

        def call(i: int, n: int) -> None:
            results[i] = s.generate(n=n, prompt=[3 + i, 4], temperature=1.0, max_tokens=3)

        def accounted() -> int:  # requests in an engine call or waiting for one
            return sum(s.engine.calls) + batcher.pending()

        s.engine.inner.pause()  # calls pile up behind the first one
        threads = [threading.Thread(target=call, args=(i, 3)) for i in range(5)]
        threads.append(threading.Thread(target=call, args=(5, 2)))  # other params: own call
        for count, t in enumerate(threads, start=1):
            t.start()
            wait_for(lambda count=count: accounted() == count)
        s.engine.inner.resume()
        for t in threads:
            t.join(timeout=60)
        assert {i: len(r) for i, r in results.items()} == {0: 3, 1: 3, 2: 3, 3: 3, 4: 3, 5: 2}
        assert sum(s.engine.calls) == 6 and len(s.engine.calls) <= 3 and max(s.engine.calls) >= 4


def test_samples_stream_before_the_call_finishes(tiny_model: Path) -> None:
    with serve(tiny_model, make_config(), wrap=Recording) as s:
        s.engine.gate = threading.Event()
        stream = s.stub.Generate(_request(n=3), timeout=60)
        first = next(stream)  # the engine is holding the other two samples
        assert not s.engine.gate_timed_out and first.completion.policy_version == 0
        s.engine.gate.set()
        assert len(list(stream)) == 2 and not s.engine.gate_timed_out


def test_pause_drains_in_flight_work_then_resume(tiny_model: Path) -> None:
    with serve(tiny_model, make_config(max_concurrent_requests=1), wrap=Recording) as s:
        s.engine.gate = threading.Event()
        held = s.stub.Generate(_request(n=2), timeout=60)
        next(held)  # one call in flight: the limit
        with pytest.raises(grpc.RpcError) as busy:
            s.generate()
        assert busy.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "rollout.max_concurrent_requests" in (busy.value.details() or "")

        pause = s.stub.Pause.future(rollout_pb2.PauseRequest(), timeout=30)
        wait_for(lambda: s.server.servicer.paused)
        assert s.readyz() == 503
        with pytest.raises(grpc.RpcError) as refused:
            s.generate()
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        time.sleep(0.2)
        assert not pause.done()  # still draining the held call
        s.engine.gate.set()
        assert len(list(held)) == 1
        assert pause.result().drained == 1
        status = s.stub.GetStatus(rollout_pb2.GetStatusRequest(), timeout=5)
        assert status.paused and not status.ready and status.requests_in_flight == 0

        s.stub.Resume(rollout_pb2.ResumeRequest(), timeout=5)
        assert s.readyz() == 200 and len(s.generate(n=2)) == 2
        assert s.stub.Pause(rollout_pb2.PauseRequest(), timeout=5).drained == 0
