"""`dapo reward`: the reward/verification service (gRPC + HTTP), until SIGINT/SIGTERM."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from reward.config import RewardSettings
from services.common.entry import role_main
from services.common.lifecycle import (
    announce,
    register_service,
    stop_event_on_signals,
    wait_until_stopped,
)


def run(config: RewardSettings) -> None:
    """Serve until a signal, printing the bound ports, then stop the workers cleanly."""
    from reward.server import create_server

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


def main(argv: Sequence[str] | None = None) -> int:
    return role_main(
        "reward", RewardSettings, run, argv, description=__doc__ or "", needs_redis=False
    )


if __name__ == "__main__":
    sys.exit(main())
