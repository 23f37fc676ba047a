"""gRPC server construction shared by every service: size limits and grpc.health.v1."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent import futures

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
    add_servicers(server)
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
