"""The reward service: gRPC `dapo.v1.RewardService` plus the HTTP API, around one pool.

`create_server(config)` builds and starts everything on the configured ports (0 = free
ones) and returns a handle, so tests run it in-process; nothing lives in globals except
the Prometheus metrics (see reward.metrics).

The gRPC method is registered with a raw-bytes deserializer: a request that protobuf
cannot decode (for example invalid UTF-8 in a string field, which another language's
client can send) gets INVALID_ARGUMENT with the reason, not an opaque INTERNAL.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from fastapi import FastAPI

from dapo.v1 import reward_pb2
from reward import adapter, metrics
from reward.config import RewardSettings
from reward.http_api import add_score_route
from reward.pool import VerifierPool
from reward.scoring import Limits, RequestError, Scorer
from reward.shaping import OverlongShaping
from services.common.grpc_server import start_grpc_server
from services.common.http import HttpServer, create_http_app, serve_http, token_guard
from services.common.security import AuthConfig

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
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
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
    return Scorer(pool, limits, shaping, cfg.default_verifier)


def create_app(scorer: Scorer, max_request_bytes: int, auth: AuthConfig | None = None) -> FastAPI:
    """/healthz, /readyz (all workers up), /metrics, /status and POST /v1/score."""
    app = create_http_app(
        "reward", ready=lambda: scorer.pool.ready, status=scorer.status, auth=auth
    )
    guard = token_guard(auth) if auth is not None and auth.scope == "all" else []
    add_score_route(app, scorer, max_request_bytes, guard)
    return app


@dataclass
class RewardServer:
    """A running reward service; `stop()` shuts down HTTP, gRPC and the workers."""

    scorer: Scorer
    grpc_server: grpc.Server
    grpc_port: int
    http: HttpServer

    @property
    def http_port(self) -> int:
        return self.http.port

    def stop(self, grace_s: float = 2.0) -> None:
        self.http.stop()
        self.grpc_server.stop(grace_s).wait()
        self.scorer.pool.close()


def create_server(config: RewardSettings) -> RewardServer:
    """Start the pool, the gRPC server and the HTTP server on the configured ports."""
    scorer = create_scorer(config)
    cfg = config.reward
    try:
        servicer = RewardServicer(scorer)
        grpc_server, grpc_port = start_grpc_server(
            cfg.server,
            servicer.register,
            [SERVICE_NAME],
            security=config.security,
            max_message_bytes=config.shared.rpc.max_message_bytes,
        )
        try:
            app = create_app(scorer, cfg.max_request_bytes, config.security.auth)
            http = serve_http(app, cfg.server.host, cfg.server.http_port)
        except BaseException:
            grpc_server.stop(0)
            raise
    except BaseException:
        scorer.pool.close()
        raise
    return RewardServer(scorer, grpc_server, grpc_port, http)
