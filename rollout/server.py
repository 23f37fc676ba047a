"""The rollout service: gRPC RolloutService over one engine, weight catch-up, registration.

GenerateGroup answers all n samples of a prompt at once, each tagged with the policy
version that produced it; GenerateGroups does so for several prompts in one call. Weights
are pulled by `rollout.weights.WeightSync`: whole and newer, or not at all. A server
refuses work until it has caught up with the learner once, then serves while it fetches
newer versions; why the controller routes on `accepting`, not `ready`:
docs/architecture.md, "The rollout server".
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Any

import grpc
import redis

from dapo.v1 import rollout_pb2, rollout_pb2_grpc
from rollout import adapter
from rollout.batcher import Batcher, BatcherClosed, Stream
from rollout.config import RolloutSettings, TorchEngineConfig
from rollout.engine import RolloutEngine, SamplingParams
from rollout.limits import GenerateLimitExceeded, Limits
from rollout.metrics import RolloutMetrics
from rollout.weights import WeightSync, WeightUpdater
from services.common.error_log import ErrorLog
from services.common.errors import REFUSAL_KEY
from services.common.grpc_server import abort, start_grpc_server
from services.common.http import HttpServer, create_http_app, serve_http
from services.common.lifecycle import advertised_address
from services.common.redis_server import connect_run
from services.common.registry import Registration
from services.common.service import register, run_is_done
from services.common.tokenizer import fingerprint
from services.weight_transport.relay import RelayHub, RelayServer

log = logging.getLogger(__name__)

CONTROL_THREADS = 8  # gRPC threads beyond max_concurrent_requests, for the control RPCs


class TokenizerMismatch(ValueError):
    """The request's prompt was tokenized by another tokenizer than this server's."""


class RolloutServicer(rollout_pb2_grpc.RolloutServiceServicer):
    """Validates requests (prompts arrive as token ids), batches through the engine,
    answers the samples with their decoded text."""

    def __init__(
        self,
        config: RolloutSettings,
        engine: RolloutEngine,
        tokenizer: Any,
        updater: WeightUpdater,
        sync: WeightSync | None = None,
    ) -> None:
        self.config, self.engine, self.tokenizer = config, engine, tokenizer
        self.fingerprint = fingerprint(tokenizer)
        self.updater, self.sync, self.metrics = updater, sync, updater.metrics
        self.limits = Limits.from_config(config)
        self.batcher = Batcher(engine, merged_sequences(config))
        self.in_flight = 0
        self.draining = threading.Event()  # set on SIGTERM: refuse new calls (drain)
        self.errors = ErrorLog()  # the last refusal or failure, for /status
        self._lock = threading.Lock()
        self._watch_metrics()

    def _watch_metrics(self) -> None:
        """The gauges that read live state when scraped."""
        self.metrics.in_flight.set_function(lambda: self.in_flight)
        self.metrics.queue.set_function(self.batcher.pending)
        self.metrics.running.set_function(lambda: self.batcher.running)
        self.metrics.version.set_function(lambda: self.engine.version)
        if self.engine.kv_cache_usage() is not None:  # None: no KV-cache pool (torch)
            self.metrics.cache_usage(lambda: self.engine.kv_cache_usage() or 0.0)
        if self.engine.model_cpu_seconds() is not None:  # None: the model runs elsewhere
            self.metrics.model_cpu(lambda: self.engine.model_cpu_seconds() or 0.0)

    def ready(self) -> bool:
        """Can serve: loaded a version and not draining (/readyz, the registry)."""
        return not self.draining.is_set() and (self.sync is None or self.sync.ready())

    def accepting(self) -> bool:
        """Takes GenerateGroup calls: caught up with the learner at least once, not draining."""
        if self.draining.is_set():
            return False
        return self.sync is None or self.sync.caught_up.is_set()

    # -- GenerateGroup(s) -------------------------------------------------------------

    def GenerateGroup(self, request: rollout_pb2.GenerateRequest, context: grpc.ServicerContext):
        return self._answer([request], context)[0]

    def GenerateGroups(
        self, request: rollout_pb2.GenerateGroupsRequest, context: grpc.ServicerContext
    ):
        if not request.groups:
            self._refuse(context, "invalid", grpc.StatusCode.INVALID_ARGUMENT, "no groups asked")
        return rollout_pb2.GenerateGroupsResponse(
            groups=self._answer(list(request.groups), context)
        )

    def _answer(
        self, requests: list[rollout_pb2.GenerateRequest], context: grpc.ServicerContext
    ) -> list[rollout_pb2.GenerateGroupResponse]:
        """Every group's samples: all prompts are queued before any is read, so an engine
        that merges calls runs them together."""
        accepted = self._accept(requests, context)
        streams: list[Stream] = []
        try:
            streams = [
                self.batcher.submit(prompt, params, request.priority)
                for request, (prompt, params) in zip(requests, accepted, strict=True)
            ]
            return [
                rollout_pb2.GenerateGroupResponse(
                    request_id=request.request_id,
                    prompt_token_ids=prompt,
                    completions=self._completions(stream),
                )
                for request, (prompt, _), stream in zip(requests, accepted, streams, strict=True)
            ]
        except ValueError as exc:  # the engine refused this prompt or these params
            abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except BatcherClosed as exc:  # stopping: the controller re-routes the group
            abort(context, grpc.StatusCode.UNAVAILABLE, str(exc))
        except Exception as exc:
            log.exception("generation failed")
            self.errors.record(f"failed {type(exc).__name__}", str(exc))
            abort(context, grpc.StatusCode.INTERNAL, f"generation failed: {exc}")
        finally:
            for stream in streams:
                stream.close()  # a failed call's other prompts: not run if still queued
            self._release()

    def _completions(self, stream: Stream) -> list[rollout_pb2.Completion]:
        """One prompt's completions in sample-index order, decoded in one batch (the
        tokenizer's batch decode: one call per group, not per sample)."""
        done = sorted(stream, key=lambda sample: sample.sample_index)
        outputs = [sample.output for sample in done]
        self.metrics.generated(
            sum(len(out.token_ids) for out in outputs), Counter(o.finish_reason for o in outputs)
        )
        texts = self.tokenizer.batch_decode(
            [out.token_ids.tolist() for out in outputs], skip_special_tokens=True
        )
        return [adapter.completion(out, text) for out, text in zip(outputs, texts, strict=True)]

    def _accept(
        self, requests: list[rollout_pb2.GenerateRequest], context: grpc.ServicerContext
    ) -> list[tuple[list[int], SamplingParams]]:
        """Parse, admit and bring the weights to the highest min_version, or abort the
        call (one refused group refuses them all)."""
        if self.draining.is_set():  # UNAVAILABLE: the controller re-routes the group
            self._refuse(
                context, "draining", grpc.StatusCode.UNAVAILABLE, "rollout server is shutting down"
            )
        if self.sync is not None and not self.sync.caught_up.is_set():
            self._refuse(
                context,
                "catching_up",
                grpc.StatusCode.UNAVAILABLE,
                "rollout server is catching up to the published weights",
            )
        try:
            accepted = [self._parse(request) for request in requests]
        except GenerateLimitExceeded as exc:  # names the config field it broke
            self._refuse(context, exc.limit, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except TokenizerMismatch as exc:  # every request would be wrong: the run stops
            self._refuse(context, "tokenizer", grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except ValueError as exc:
            self._refuse(context, "invalid", grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        refusal = self._admit()
        if refusal is not None:
            self._refuse(context, *refusal)
        wanted = max(request.min_version for request in requests)
        if not self._reach_version(wanted, context):
            self._release()
            self._refuse(
                context,
                "behind",
                grpc.StatusCode.UNAVAILABLE,
                f"serving version {self.engine.version}, the request needs "
                f">= {wanted} and it did not arrive in time",
            )
        return accepted

    def _reach_version(self, wanted: int, context: grpc.ServicerContext) -> bool:
        """Wait (bounded) until the served weights are at least version `wanted`.

        The weight sync is told to pull at once rather than at its next poll: a caller
        that asks for a version knows the learner has published it.
        """
        if self.engine.version >= wanted:
            return True
        if self.sync is not None:
            self.sync.wake()
        timeout = self.config.rollout.min_version_wait_s
        remaining = context.time_remaining() if context is not None else None
        return self.updater.wait_for(wanted, min(timeout, remaining or timeout))

    def _refuse(self, context: grpc.ServicerContext, reason: str, code: Any, message: str):
        self.metrics.rejected.labels(reason).inc()
        self.errors.record(f"refused {reason}", message)
        context.set_trailing_metadata(((REFUSAL_KEY, reason),))
        abort(context, code, message)

    def _parse(self, request: rollout_pb2.GenerateRequest) -> tuple[list[int], SamplingParams]:
        """Limits first, then the prompt's ids and engine params (ValueError if bad)."""
        self.limits.check_request(request)
        prompt = self._prompt_ids(request)
        self.limits.check_prompt(prompt, len(self.tokenizer))
        params = adapter.sampling_params(
            request.sampling,
            request.n,
            self.config.shared.sampling,
            self.config.shared.max_response_length,
        )
        return prompt, params

    def _prompt_ids(self, request: rollout_pb2.GenerateRequest) -> list[int]:
        """The ids as the controller rendered them: a server never tokenizes a prompt, and
        refuses ids made by another tokenizer than its model's."""
        theirs = request.tokenizer_fingerprint
        if theirs and theirs != self.fingerprint:
            model = self.config.rollout.model_path or self.config.shared.model_path
            raise TokenizerMismatch(
                f"the prompt was tokenized by tokenizer {theirs}, this server's ({model}) is "
                f"{self.fingerprint}: one model path must decide every role's tokenizer "
                "(shared.model_path, rollout.model_path)"
            )
        return list(request.prompt_token_ids)

    def _admit(self) -> tuple[str, Any, str] | None:
        """Count the call in flight, or say why not (too many calls: each holds a gRPC
        thread, however many groups it asks for)."""
        limit = self.config.rollout.max_concurrent_requests
        with self._lock:
            if self.in_flight >= limit:
                message = f"{self.in_flight} requests in flight = rollout.max_concurrent_requests"
                return "busy", grpc.StatusCode.RESOURCE_EXHAUSTED, message
            self.in_flight += 1
        return None

    def _release(self) -> None:
        """A call admitted by `_admit` is over."""
        with self._lock:
            self.in_flight -= 1

    # -- control ----------------------------------------------------------------------

    def GetStatus(self, request, context):
        return rollout_pb2.RolloutStatus(
            version=self.engine.version,
            ready=self.ready(),
            requests_in_flight=self.in_flight,
            engine=self.config.rollout.engine.kind,
            model=str(self.config.rollout.model_path or self.config.shared.model_path),
            tokenizer_fingerprint=self.fingerprint,
        )


def merged_sequences(config: RolloutSettings) -> int:
    """Most sequences in one merged engine call (engines that take one call at a time)."""
    engine = config.rollout.engine
    if not isinstance(engine, TorchEngineConfig):
        return config.rollout.max_n
    return max(engine.max_batch_size * engine.merged_batches, config.rollout.max_n)


def build_engine(config: RolloutSettings) -> RolloutEngine:
    """The configured engine over the configured model dir."""
    from pathlib import Path

    from services.common.errors import DapoError

    model = config.rollout.model_path or config.shared.model_path
    if model is None or not Path(model).is_dir():
        raise DapoError(f"model directory not found: {model} (set rollout.model_path)")
    if config.rollout.engine.kind == "vllm":
        try:
            from rollout.vllm_engine import VllmEngine
        except ImportError as exc:
            raise DapoError(f"the vLLM engine needs the extra dapo[vllm]: {exc}") from exc
        return VllmEngine.from_config(model, config.rollout.engine, config.partial_rollouts())
    import torch

    from rollout.torch_engine import TorchEngine

    if config.rollout.engine.num_threads is not None:
        torch.set_num_threads(config.rollout.engine.num_threads)
    return TorchEngine.from_config(model, config.rollout.engine, config.partial_rollouts())


class RolloutServer:
    """gRPC + HTTP + registry + weight sync around one engine."""

    def __init__(self, config: RolloutSettings, client: redis.Redis | None, engine: RolloutEngine):
        self.config, self.client, self.engine = config, client, engine
        self.metrics = RolloutMetrics()
        self.updater = WeightUpdater(engine, self.metrics)
        self.relay = start_relay(config) if client is not None else None
        hub = self.relay.hub if self.relay is not None else None
        self.sync = WeightSync(config, client, self.updater, hub=hub) if client else None
        tokenizer = engine.tokenizer
        self.servicer = RolloutServicer(config, engine, tokenizer, self.updater, self.sync)
        self.stop_event = threading.Event()
        self.registration: Registration | None = None
        self._announced: dict[str, Any] = {}
        self._announce_lock = threading.Lock()
        self.grpc_server: grpc.Server | None = None
        self.grpc_port = 0
        self.http: HttpServer | None = None
        self.run_done = False

    @property
    def ports(self) -> dict[str, int]:
        return {"grpc": self.grpc_port, "http": self.http.port if self.http else 0}

    def _serve(self) -> None:
        """Bind gRPC and HTTP on the configured ports (0 = free ones)."""
        config = self.config
        self.grpc_server, self.grpc_port = start_grpc_server(
            config.rollout.server,
            lambda s: rollout_pb2_grpc.add_RolloutServiceServicer_to_server(self.servicer, s),
            ["dapo.v1.RolloutService"],
            max_workers=config.rollout.max_concurrent_requests + CONTROL_THREADS,
            security=config.security,
            max_message_bytes=config.shared.rpc.max_message_bytes,
        )
        app = create_http_app(
            "rollout",
            ready=self.ready,
            status=self.status,
            registry=self.metrics.registry,
            auth=config.security.auth,
        )
        self.http = serve_http(app, config.rollout.server.host, config.rollout.server.http_port)

    def ready(self) -> bool:
        return self.servicer.ready()

    def status(self) -> dict[str, Any]:
        published = self.sync.published() if self.sync is not None else None
        return {
            "version": self.engine.version,
            "published_version": published,
            "ready": self.ready(),
            "accepting": self.servicer.accepting(),
            "in_flight": self.servicer.in_flight,
            "queue": self.servicer.batcher.pending(),
            "engine": self.config.rollout.engine.kind,
            "model_cpu_s": self.engine.model_cpu_seconds(),
            "last_error": self.servicer.errors.snapshot(),
        }

    def start(self) -> RolloutServer:
        """Serve; with Redis, register as not ready and catch up with the learner in the
        background."""
        self._serve()
        assert self.http is not None
        if self.client is None or self.sync is None:
            return self
        host = self.config.rollout.server.host
        self.registration = register(
            self.client,
            self.config,
            "rollout",
            host,
            self.grpc_port,
            http=advertised_address(host, self.http.port),
            ready=False,
            accepting=False,
            version=self.engine.version,
            relay=self.relay.port if self.relay else 0,
            tokenizer=self.servicer.fingerprint,
        )
        self.sync.instance = self.registration.info["instance"]
        threading.Thread(
            target=self.sync.run,
            args=(self.stop_event, self._announce),
            daemon=True,
            name="weight-sync",
        ).start()
        return self

    def _announce(self) -> None:
        """Tell the registry about readiness and version, when they changed."""
        if self.registration is None:
            return
        servicer = self.servicer
        state = {
            "ready": servicer.ready(),
            "accepting": servicer.accepting(),
            "version": self.engine.version,
        }
        with self._announce_lock:
            if state == self._announced:
                return
            try:
                self.registration.update(**state)
                self._announced = state
            except redis.RedisError as exc:
                log.warning("registry update failed, the heartbeat will retry: %s", exc)

    def wait(self, stop: threading.Event) -> None:
        """Serve until a signal, or until the run's learner marked the run done."""
        while not stop.wait(0.5):
            if self.client is not None and run_is_done(self.client, self.config):
                self.run_done = True
                return

    def drain(self) -> None:
        """Stop taking work (registry `accepting=False`, new calls UNAVAILABLE), then let
        the calls held finish, for at most rollout.drain_timeout_s: a scale-down loses
        no generation it can still finish, and no group waits on a server going away."""
        self.servicer.draining.set()
        self._announce()
        started = time.monotonic()
        deadline = started + self.config.rollout.drain_timeout_s
        held = self.servicer.in_flight
        while self.servicer.in_flight > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        log.info(
            "drained in %.2fs: %d calls held, %d cut off (re-routed by the controller)",
            time.monotonic() - started,
            held,
            self.servicer.in_flight,
        )

    def _should_drain(self) -> bool:
        """Only mid-run: once the run is done there is no one to hand work back to."""
        if self.run_done or self.registration is None or self.client is None:
            return False
        try:
            return not run_is_done(self.client, self.config)
        except redis.RedisError:
            return True

    def stop(self) -> None:
        if self._should_drain():
            self.drain()
        self.stop_event.set()
        if self.sync is not None:
            self.sync.wake()  # leave the poll wait now
        if self.registration is not None:
            self.registration.stop()
        if self.grpc_server is not None:
            self.grpc_server.stop(grace=2).wait()
        self.servicer.batcher.close()
        if self.relay is not None:
            self.relay.stop()
        if self.http is not None:
            self.http.stop()


def start_relay(config: RolloutSettings) -> RelayServer | None:
    """This server's relay (rollout.relay), listening, or None when relaying is off."""
    if not config.rollout.relay:
        return None
    rpc = config.shared.rpc
    hub = RelayHub(rpc.max_message_bytes, config.rollout.relay_timeout_s)
    host, security = config.rollout.server.host, config.security
    return RelayServer(
        hub, host, config.rollout.relay_port, security.tls, security.auth.secret()
    ).start()


def create_server(
    config: RolloutSettings,
    client: redis.Redis | None = None,
    engine: RolloutEngine | None = None,
) -> RolloutServer:
    """A rollout server around the configured engine, with Redis when a URL is set (the
    run's registry and weight sync); not yet started."""
    if client is None and config.shared.redis_url:
        client = connect_run(config)
    return RolloutServer(config, client, engine or build_engine(config))
