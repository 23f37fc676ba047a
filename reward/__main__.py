"""`dapo reward`: the reward/verification service (gRPC + HTTP), until SIGINT/SIGTERM."""

from __future__ import annotations

from reward.server import create_server
from services.common.config import DapoConfig
from services.common.lifecycle import (
    announce,
    register_service,
    stop_event_on_signals,
    wait_until_stopped,
)


def run(config: DapoConfig) -> None:
    """Serve until a signal, printing the bound ports, then stop the workers cleanly."""
    stop = stop_event_on_signals()
    server = create_server(config)
    announce("reward", grpc=server.grpc_port, http=server.http_port)
    registration = register_service(config, "reward", config.reward.server.host, server.grpc_port)
    try:
        wait_until_stopped(stop, registration)
    finally:
        if registration is not None:
            registration.stop()
        server.stop()


if __name__ == "__main__":
    from services.common.config import load_config

    run(load_config())
