"""`dapo learner`: trains on informative groups and serves the new weights.

Under torchrun (WORLD_SIZE > 1) rank 0 runs the service and the other ranks follow it.
"""

from __future__ import annotations

import os

from services.common.config import DapoConfig
from services.common.lifecycle import announce, stop_event_on_signals
from services.common.redis_server import connect_run


def run(config: DapoConfig) -> None:
    from services.common.malloc import keep_freed_memory

    keep_freed_memory()  # weight buckets reuse warm memory (services/common/malloc.py)
    assert config.shared.redis_url
    if int(os.environ.get("RANK", "0")) > 0:
        from learner.server import Follower

        Follower(config).run()
        return
    from learner.server import LearnerServer

    stop = stop_event_on_signals()
    server = LearnerServer(config, connect_run(config))
    announce("learner", grpc=server.grpc_port, http=server.http.port)
    try:
        server.learner.run(stop)
        # Keep serving the final weights a while (evaluation, late rollout servers).
        stop.wait(config.learner.linger_s)
    finally:
        server.stop()
