"""gRPC server construction shared by every service: size limits and grpc.health.v1.

Servicers are added through `StrictServer`, which decodes requests inside the method
instead of in grpc: bytes protobuf cannot parse (truncated, invalid UTF-8 in a string)
get INVALID_ARGUMENT naming the method, not grpc's opaque INTERNAL "Exception
deserializing request!" (found by tests/test_fuzz_rollout.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.common.errors import PortInUseError
from services.common.server_config import ServerConfig


def grpc_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """Channel/server options bounding message sizes in both directions."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


BEHAVIORS = {
    (False, False): "unary_unary",
    (False, True): "unary_stream",
    (True, False): "stream_unary",
    (True, True): "stream_stream",
}


def _decode(decode: Callable[[bytes], Any], data: bytes, context: Any, method: str) -> Any:
    try:
        return decode(data)
    except Exception as exc:  # protobuf raises DecodeError or a runtime-specific error
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"cannot decode {method} request: {exc}")


def strict_handler(handler: Any, method: str) -> Any:
    """The same method handler, decoding its requests itself (INVALID_ARGUMENT if it can't)."""
    decode = None if handler is None else handler.request_deserializer
    if decode is None:
        return handler
    field = BEHAVIORS[(handler.request_streaming, handler.response_streaming)]
    behavior = getattr(handler, field)

    def run(request: Any, context: Any) -> Any:
        if handler.request_streaming:
            decoded: Iterator[Any] = (_decode(decode, r, context, method) for r in request)
            return behavior(decoded, context)
        return behavior(_decode(decode, request, context, method), context)

    return handler._replace(request_deserializer=None, **{field: run})


class _StrictGeneric(grpc.GenericRpcHandler):
    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def service(self, handler_call_details: Any) -> Any:
        handler = self._inner.service(handler_call_details)
        return None if handler is None else strict_handler(handler, handler_call_details.method)


class StrictServer:
    """A grpc.Server seen through which every added method decodes strictly."""

    def __init__(self, server: grpc.Server) -> None:
        self._server = server

    def add_generic_rpc_handlers(self, handlers: Sequence[Any]) -> None:
        self._server.add_generic_rpc_handlers(tuple(_StrictGeneric(h) for h in handlers))

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        strict = {m: strict_handler(h, f"/{service}/{m}") for m, h in handlers.items()}
        self._server.add_registered_method_handlers(service, strict)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server, name)


def start_grpc_server(
    cfg: ServerConfig,
    add_servicers: Callable[[grpc.Server], None],
    service_names: Sequence[str],
    max_workers: int = 16,
) -> tuple[grpc.Server, int]:
    """Start a server with the given servicers plus health; return it and its bound port."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers),
        options=[*grpc_options(cfg.max_message_bytes), ("grpc.so_reuseport", 0)],
    )
    add_servicers(StrictServer(server))  # type: ignore[arg-type]
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", *service_names):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    address = f"{cfg.host}:{cfg.grpc_port}"
    try:
        port = server.add_insecure_port(address)
    except RuntimeError:
        port = 0
    if port == 0:
        raise PortInUseError(f"cannot bind gRPC port {address} (in use or not permitted)")
    server.start()
    return server, port


def insecure_channel(address: str, max_message_bytes: int = 64 * 1024 * 1024) -> grpc.Channel:
    """A client channel with the same size limits as our servers."""
    return grpc.insecure_channel(address, options=grpc_options(max_message_bytes))
