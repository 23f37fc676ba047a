"""`dapo rollout`: serve one inference engine over gRPC."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from rollout.config import RolloutSettings
from services.common.entry import role_main
from services.common.lifecycle import announce, stop_event_on_signals
from services.common.redis_server import connect_run


def run(config: RolloutSettings) -> None:
    from rollout.server import RolloutServer, build_engine
    from services.common.malloc import keep_freed_memory

    if config.shared.torch_threads:  # several torch processes must not oversubscribe
        import torch

        torch.set_num_threads(config.shared.torch_threads)
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


def main(argv: Sequence[str] | None = None) -> int:
    return role_main(
        "rollout", RolloutSettings, run, argv, description=__doc__ or "", needs_redis=False
    )


if __name__ == "__main__":
    sys.exit(main())
