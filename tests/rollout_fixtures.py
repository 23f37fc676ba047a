"""Shared by the rollout service tests: a real RolloutServer (torch engine, tiny model)
with small limits, a stub and HTTP client for it, updates as the learner serves them."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import redis
import torch

from dapo.v1 import rollout_pb2, rollout_pb2_grpc
from learner.weights import WeightServicer, add_weight_service
from rollout.server import RolloutServer
from rollout.torch_engine import TorchEngine
from services.common.adapters import sample_from_completion
from services.common.grpc_server import insecure_channel, start_grpc_server
from services.common.keys import RunKeys
from services.common.registry import Registration, discover
from services.common.server_config import ServerConfig
from services.tools.config import DapoConfig
from services.weight_transport.assembly import Assembling
from services.weight_transport.tensor_codec import RawTensor, encode_bucket_bytes
from services.weight_transport.torch_codec import from_torch

MAX_N, MAX_PROMPT, MAX_RESPONSE, MAX_REQUEST_BYTES = 4, 12, 8, 2048
PROMPT = [3, 5, 7, 9]
SEEDED = rollout_pb2.SamplingParams(temperature=1.0, max_tokens=4, seed=5)
HTTP = httpx.Client(timeout=5)


def make_config(run: str = "svc", **rollout: Any) -> DapoConfig:
    return DapoConfig.model_validate(
        {
            "shared": {
                "run_name": run,
                "max_prompt_length": MAX_PROMPT,
                "max_response_length": MAX_RESPONSE,
                "group_size": 2,
                "overlong_buffer_length": 0,
                "registry_ttl_s": 2.0,
            },
            "rollout": {
                "server": {"grpc_port": 0, "http_port": 0},
                "max_n": MAX_N,
                "max_request_bytes": MAX_REQUEST_BYTES,
                "weight_poll_s": 0.05,
                **rollout,
            },
        }
    )


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
        completions = list(self.stub.GenerateGroup(request, timeout=60).completions)
        assert len(completions) == n
        return completions

    def fingerprint(self) -> list[tuple[list[int], list[float]]]:
        """A seeded generation: equal iff the weights are equal."""
        return [
            (s.token_ids.tolist(), [round(x, 4) for x in s.logprobs.tolist()])
            for s in map(sample_from_completion, self.generate(n=1))
        ]

    def readyz(self) -> int:
        return HTTP.get(f"{self.url}/readyz").status_code

    def load(self, frames: list[bytes]) -> int:
        """Apply serialized buckets as the weight sync applies pulled ones: the new version."""
        return self.server.updater.apply(Assembling.of_frames(frames))


def frames(tensors: list[RawTensor], version: int) -> list[bytes]:
    """An update as the learner serves it: serialized buckets of 4 KiB."""
    return [bytes(f) for f in encode_bucket_bytes(tensors, version, 4096)]


@contextmanager
def serve(
    model: Path, config: DapoConfig, client: redis.Redis | None = None, wrap: Callable = lambda e: e
) -> Iterator[Served]:
    engine = wrap(TorchEngine(model, device="cpu", max_batch_size=8))
    with serve_engine(engine, config, client) as served:
        yield served


@contextmanager
def serve_engine(engine: Any, config: DapoConfig, client: redis.Redis | None) -> Iterator[Served]:
    """A started RolloutServer around `engine` and a client of it; both closed at the end."""
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
