"""`dapo learner`: trains on informative groups and serves the new weights."""

from __future__ import annotations

from learner.server import LearnerServer
from services.common.config import DapoConfig
from services.common.lifecycle import announce, stop_event_on_signals
from services.common.redis_server import connect


def run(config: DapoConfig) -> None:
    assert config.shared.redis_url
    stop = stop_event_on_signals()
    server = LearnerServer(config, connect(config.shared.redis_url))
    announce("learner", grpc=server.grpc_port, http=server.http.port)
    try:
        server.learner.run(stop)
        # Keep serving the final weights a while (evaluation, late rollout servers).
        stop.wait(config.learner.linger_s)
    finally:
        server.stop()
