"""The rollout service: gRPC RolloutService over one engine, weight catch-up, registration.

Weights: the learner publishes its version in Redis; a sync thread sees a newer version,
pulls the full weights from the learner's WeightService, and loads them only once every
byte has arrived and been checked (a half-received update is never applied). Versions
only move forward. `/readyz` and the registry's `ready` flag stay false until the served
version equals the published one, so a late or restarted server catches up before work.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import grpc
import redis
from prometheus_client import Counter, Gauge, Histogram

from dapo.v1 import learner_pb2, learner_pb2_grpc, rollout_pb2, rollout_pb2_grpc, tensor_pb2
from rollout import adapter
from rollout.batcher import Batcher
from rollout.engine import RolloutEngine
from services.common.config import DapoConfig
from services.common.grpc_server import insecure_channel, start_grpc_server
from services.common.http import HttpServer, create_http_app, serve_http
from services.common.keys import RunKeys
from services.common.registry import Registration, discover
from services.common.tensor_codec import TensorWireError, WeightAssembler, to_torch

log = logging.getLogger(__name__)

TOKENS = Counter("dapo_rollout_tokens_generated_total", "Tokens generated")
SAMPLES = Counter("dapo_rollout_samples_total", "Samples generated", ["finish_reason"])
IN_FLIGHT = Gauge("dapo_rollout_requests_in_flight", "Generate calls being served")
QUEUE = Gauge("dapo_rollout_queue_depth", "Requests waiting for the engine")
VERSION = Gauge("dapo_rollout_policy_version", "Policy version being served")
WEIGHT_SECONDS = Histogram("dapo_rollout_weight_update_seconds", "Fetch + load of new weights")


class RolloutServicer(rollout_pb2_grpc.RolloutServiceServicer):
    """Validates requests, tokenises, batches through the engine, streams samples back."""

    def __init__(self, config: DapoConfig, engine: RolloutEngine, tokenizer: Any) -> None:
        self.config, self.engine, self.tokenizer = config, engine, tokenizer
        max_sequences = getattr(config.rollout.engine, "max_batch_size", 256)
        self.batcher = Batcher(engine, max(max_sequences, config.rollout.max_n))
        self.in_flight = 0
        self.paused = False
        self._lock = threading.Lock()

    def _prompt_ids(self, request: rollout_pb2.GenerateRequest) -> list[int]:
        if request.prompt_token_ids:
            return list(request.prompt_token_ids)
        if request.apply_chat_template:
            messages = [{"role": "user", "content": request.prompt}]
            return list(
                self.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=True, return_dict=False
                )
            )
        return self.tokenizer.encode(request.prompt, add_special_tokens=False)

    def _check(self, request: rollout_pb2.GenerateRequest, prompt: list[int]) -> str | None:
        """The first violated limit, named, or None."""
        shared, cfg = self.config.shared, self.config.rollout
        vocab = len(self.tokenizer)
        if not 1 <= request.n <= cfg.max_n:
            return f"n={request.n} outside [1, max_n={cfg.max_n}]"
        if not prompt:
            return "empty prompt"
        if len(prompt) > shared.max_prompt_length:
            return f"prompt has {len(prompt)} tokens > max_prompt_length={shared.max_prompt_length}"
        if request.sampling.max_tokens > shared.max_response_length:
            return (
                f"max_tokens={request.sampling.max_tokens} > "
                f"max_response_length={shared.max_response_length}"
            )
        if any(not 0 <= t < vocab for t in prompt):
            return f"prompt token id outside the vocabulary [0, {vocab})"
        return None

    def Generate(self, request: rollout_pb2.GenerateRequest, context: grpc.ServicerContext):
        if self.paused:
            context.abort(grpc.StatusCode.UNAVAILABLE, "rollout server is paused")
        prompt = self._prompt_ids(request)
        problem = self._check(request, prompt)
        if problem is not None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        try:
            params = adapter.sampling_params(
                request.sampling, request.n, self.config.rollout.sampling,
                self.config.shared.max_response_length,
            )  # fmt: skip
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        yield from self._stream(request.request_id, prompt, params)

    def _stream(self, request_id: str, prompt: list[int], params: Any) -> Iterator[Any]:
        with self._lock:
            self.in_flight += 1
            IN_FLIGHT.set(self.in_flight)
        try:
            QUEUE.set(self.batcher.pending())
            for sample in self.batcher.submit(prompt, params):
                out = sample.output
                TOKENS.inc(len(out.token_ids))
                SAMPLES.labels(out.finish_reason).inc()
                text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
                yield rollout_pb2.GenerateResponse(
                    request_id=request_id,
                    sample_index=sample.sample_index,
                    prompt_token_ids=prompt,
                    completion=adapter.completion(out, text),
                )
        finally:
            with self._lock:
                self.in_flight -= 1
                IN_FLIGHT.set(self.in_flight)

    def Pause(self, request, context):
        self.paused = True
        self.engine.pause()
        return rollout_pb2.PauseResponse(drained=0)

    def Resume(self, request, context):
        self.paused = False
        self.engine.resume()
        return rollout_pb2.ResumeResponse()

    def UpdateWeights(self, request_iterator: Iterator[tensor_pb2.WeightBucket], context):
        try:
            version = apply_update(self.engine, request_iterator)
        except (TensorWireError, ValueError) as exc:
            return rollout_pb2.UpdateWeightsResponse(
                version=self.engine.version, applied=False, error=str(exc)
            )
        return rollout_pb2.UpdateWeightsResponse(version=version, applied=True)

    def GetStatus(self, request, context):
        return rollout_pb2.RolloutStatus(
            version=self.engine.version, paused=self.paused, ready=not self.paused,
            requests_in_flight=self.in_flight, engine=self.config.rollout.engine.kind,
            model=str(self.config.rollout.model_path or self.config.shared.model_path),
        )  # fmt: skip


def apply_update(engine: RolloutEngine, buckets: Iterator[tensor_pb2.WeightBucket]) -> int:
    """Assemble a whole update, then load it; raise on anything wrong (old weights stay)."""
    started = time.monotonic()
    assembler = WeightAssembler()
    for bucket in buckets:
        assembler.add(bucket)
    tensors = assembler.result()
    version = assembler.version or 0
    if version <= engine.version:
        raise ValueError(f"version {version} is not newer than served {engine.version}")
    engine.load_weights(((t.name, to_torch(t)) for t in tensors), version)
    WEIGHT_SECONDS.observe(time.monotonic() - started)
    VERSION.set(version)
    return version


class WeightSync:
    """Pulls new weights from the learner whenever the published version moves ahead."""

    def __init__(self, config: DapoConfig, client: redis.Redis, engine: RolloutEngine) -> None:
        self.config, self.client, self.engine = config, client, engine
        self.keys = RunKeys(config.shared.run_name)
        self.on_change: list[Any] = []

    def published(self) -> int:
        return int(self.client.get(self.keys.version) or 0)

    def ready(self) -> bool:
        return self.engine.version >= self.published()

    def sync_once(self) -> bool:
        """Fetch and load the latest version if newer; True if weights changed."""
        target = self.published()
        if target <= self.engine.version:
            return False
        learners = discover(self.client, self.keys, "learner")
        if not learners:
            return False
        channel = insecure_channel(
            learners[0]["address"], self.config.learner.server.max_message_bytes
        )
        try:
            stub = learner_pb2_grpc.WeightServiceStub(channel)
            buckets = stub.FetchWeights(learner_pb2.FetchWeightsRequest(version=0), timeout=300)
            version = apply_update(self.engine, buckets)
        finally:
            channel.close()
        log.info("loaded weights version=%d", version)
        return True

    def run(self, stop: threading.Event) -> None:
        while not stop.wait(self.config.rollout.weight_poll_s):
            try:
                changed = self.sync_once()
            except (grpc.RpcError, TensorWireError, ValueError, redis.RedisError) as exc:
                log.warning("weight sync failed, will retry: %s", exc)
                continue
            for callback in self.on_change if changed else ():
                callback()


def build_engine(config: DapoConfig) -> RolloutEngine:
    """The configured engine over the configured model dir."""
    from pathlib import Path

    from services.common.errors import DapoError

    model = config.rollout.model_path or config.shared.model_path
    if model is None or not Path(model).is_dir():
        raise DapoError(f"model directory not found: {model} (set rollout.model_path)")
    if config.rollout.engine.kind == "vllm":
        raise DapoError("the vLLM engine is not available yet; use engine.kind=torch")
    from rollout.torch_engine import TorchEngine

    return TorchEngine.from_config(model, config.rollout.engine)


class RolloutServer:
    """gRPC + HTTP + registry + weight sync around one engine."""

    def __init__(self, config: DapoConfig, client: redis.Redis | None, engine: RolloutEngine):
        self.config, self.client, self.engine = config, client, engine
        self.servicer = RolloutServicer(config, engine, engine.tokenizer)  # type: ignore[attr-defined]
        self.stop_event = threading.Event()
        self.sync = WeightSync(config, client, engine) if client is not None else None
        self.registration: Registration | None = None
        self.grpc_server, self.grpc_port = start_grpc_server(
            config.rollout.server,
            lambda s: rollout_pb2_grpc.add_RolloutServiceServicer_to_server(self.servicer, s),
            ["dapo.v1.RolloutService"],
        )
        app = create_http_app("rollout", ready=self.ready, status=self.status)
        self.http: HttpServer = serve_http(
            app, config.rollout.server.host, config.rollout.server.http_port
        )

    def ready(self) -> bool:
        return not self.servicer.paused and (self.sync is None or self.sync.ready())

    def status(self) -> dict[str, Any]:
        return {
            "version": self.engine.version,
            "ready": self.ready(),
            "in_flight": self.servicer.in_flight,
            "engine": self.config.rollout.engine.kind,
        }

    def start(self) -> RolloutServer:
        """Catch up with the learner, then register as a server that takes work."""
        if self.client is None or self.sync is None:
            return self
        host = self.config.rollout.server.host
        address = f"{socket.gethostname() if host == '0.0.0.0' else host}:{self.grpc_port}"
        self.registration = Registration(
            self.client, RunKeys(self.config.shared.run_name), "rollout",
            f"rollout-{uuid.uuid4().hex[:8]}",
            {"address": address, "ready": False, "version": self.engine.version},
        ).start()  # fmt: skip
        self.sync.on_change.append(self._announce)
        self._announce()
        threading.Thread(target=self.sync.run, args=(self.stop_event,), daemon=True).start()
        return self

    def _announce(self) -> None:
        VERSION.set(self.engine.version)
        if self.registration is not None:
            self.registration.update(ready=self.ready(), version=self.engine.version)

    def stop(self) -> None:
        self.stop_event.set()
        if self.registration is not None:
            self.registration.stop()
        self.grpc_server.stop(grace=2).wait()
        self.servicer.batcher.close()
        self.http.stop()
