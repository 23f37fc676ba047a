"""The reward service: gRPC `dapo.v1.RewardService` plus the HTTP API, around one pool.

`create_server(config).start()` starts everything on the configured ports (0 = free
ones) and returns the handle, so tests run it in-process; nothing lives in globals
except the Prometheus metrics (see reward.metrics).

The gRPC method is registered with a raw-bytes deserializer: a request that protobuf
cannot decode (for example invalid UTF-8 in a string field, which another language's
client can send) gets INVALID_ARGUMENT with the reason, not an opaque INTERNAL.
"""

from __future__ import annotations

import threading

import grpc
from fastapi import FastAPI

from dapo.v1 import reward_pb2
from reward import adapter, metrics
from reward.config import RewardSettings
from reward.http_api import add_score_route
from reward.pool import VerifierPool
from reward.scoring import Limits, RequestError, ScoreLimitExceeded, Scorer
from reward.shaping import OverlongShaping
from services.common.errors import REFUSAL_KEY
from services.common.grpc_server import abort, start_grpc_server
from services.common.http import HttpServer, create_http_app, serve_http, token_guard
from services.common.redis_server import connect_run
from services.common.registry import Registration
from services.common.security import AuthConfig
from services.common.service import register, run_is_done

SERVICE_NAME = "dapo.v1.RewardService"


class RewardServicer:
    """gRPC front end: bytes → adapter → Scorer → adapter → ScoreResponse."""

    def __init__(self, scorer: Scorer) -> None:
        self.scorer = scorer

    def score(self, data: bytes, context: grpc.ServicerContext) -> reward_pb2.ScoreResponse:
        try:
            items = adapter.inputs_from_proto(adapter.parse_request(data))
            outputs = self.scorer.score(items, "grpc")
        except RequestError as exc:
            refusal = exc.limit if isinstance(exc, ScoreLimitExceeded) else "invalid"
            context.set_trailing_metadata(((REFUSAL_KEY, refusal),))
            abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return adapter.outputs_to_proto(outputs)

    def register(self, server: grpc.Server) -> None:
        """Add the Score method to `server` (what start_grpc_server's callback does)."""
        handlers = {
            "Score": grpc.unary_unary_rpc_method_handler(
                self.score,
                request_deserializer=None,  # raw bytes: decode errors become INVALID_ARGUMENT
                response_serializer=reward_pb2.ScoreResponse.SerializeToString,
            )
        }
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),)
        )
        server.add_registered_method_handlers(SERVICE_NAME, handlers)


def create_scorer(config: RewardSettings) -> Scorer:
    """The pool (started) and the scoring core, from the reward and shared sections."""
    cfg, shared = config.reward, config.shared
    pool = VerifierPool(
        num_workers=cfg.num_workers,
        timeout_s=cfg.timeout_s,
        soft_timeout_s=cfg.soft_timeout_s,
        start_method=cfg.start_method,
        on_restart=lambda reason: metrics.POOL_RESTARTS.labels(reason).inc(),
    ).start()
    shaping = OverlongShaping(
        max_len=shared.max_response_length,
        buffer_len=shared.overlong_buffer_length,
        factor=shared.overlong_penalty_factor,
        enabled=cfg.overlong_punishment,
    )
    limits = Limits(
        config.shared.rpc.max_score_items, cfg.max_response_chars, cfg.max_ground_truth_chars
    )
    return Scorer(pool, limits, shaping, cfg.default_verifier, cfg.inline_rules)


def create_app(scorer: Scorer, max_request_bytes: int, auth: AuthConfig | None = None) -> FastAPI:
    """/healthz, /readyz (all workers up), /metrics, /status and POST /v1/score."""
    app = create_http_app(
        "reward", ready=lambda: scorer.pool.ready, status=scorer.status, auth=auth
    )
    guard = token_guard(auth) if auth is not None and auth.scope == "all" else []
    add_score_route(app, scorer, max_request_bytes, guard)
    return app


class RewardServer:
    """The reward service as a `Service`: `start()` starts the pool, gRPC, HTTP and (with
    Redis) the registration; `stop()` shuts all of them down."""

    def __init__(self, config: RewardSettings) -> None:
        self.config = config
        self._scorer: Scorer | None = None
        self.grpc_server: grpc.Server | None = None
        self.grpc_port = 0
        self.http: HttpServer | None = None
        self.registration: Registration | None = None

    @property
    def scorer(self) -> Scorer:
        assert self._scorer is not None, "start() the server first"
        return self._scorer

    @property
    def http_port(self) -> int:
        return self.http.port if self.http else 0

    @property
    def ports(self) -> dict[str, int]:
        return {"grpc": self.grpc_port, "http": self.http_port}

    def start(self) -> RewardServer:
        """Start everything on the configured ports; on any failure stop what started."""
        config, cfg = self.config, self.config.reward
        self._scorer = create_scorer(config)
        try:
            self.grpc_server, self.grpc_port = start_grpc_server(
                cfg.server,
                RewardServicer(self.scorer).register,
                [SERVICE_NAME],
                security=config.security,
                max_message_bytes=config.shared.rpc.max_message_bytes,
            )
            app = create_app(self.scorer, cfg.max_request_bytes, config.security.auth)
            self.http = serve_http(app, cfg.server.host, cfg.server.http_port)
            if config.shared.redis_url:
                client = connect_run(config)
                self.registration = register(
                    client, config, "reward", cfg.server.host, self.grpc_port
                )
        except BaseException:
            self.stop(0)
            raise
        return self

    def wait(self, stop: threading.Event) -> None:
        """Serve until a signal, or until the run's learner marked the run done."""
        while not stop.wait(0.5):
            if self.registration and run_is_done(self.registration.client, self.config):
                return

    def stop(self, grace_s: float = 2.0) -> None:
        if self.registration is not None:
            self.registration.stop()
        if self.http is not None:
            self.http.stop()
        if self.grpc_server is not None:
            self.grpc_server.stop(grace_s).wait()
        if self._scorer is not None:
            self._scorer.pool.close()


def create_server(config: RewardSettings) -> RewardServer:
    """The reward service on the configured ports (0 = free ones), not yet started."""
    return RewardServer(config)
