"""`dapo rollout`: serve one inference engine over gRPC."""

from __future__ import annotations

from rollout.server import RolloutServer, build_engine
from services.common.config import DapoConfig
from services.common.lifecycle import announce, stop_event_on_signals
from services.common.redis_server import connect_run


def run(config: DapoConfig) -> None:
    from services.common.malloc import keep_freed_memory

    keep_freed_memory()  # received weights reuse warm memory (services/common/malloc.py)

    stop = stop_event_on_signals()
    client = connect_run(config) if config.shared.redis_url else None
    server = RolloutServer(config, client, build_engine(config)).start()
    announce("rollout", grpc=server.grpc_port, http=server.http.port)
    try:
        while not stop.wait(0.5):
            if client is not None and client.exists(server.sync.keys.done):  # type: ignore[union-attr]
                break
    finally:
        server.stop()
