"""`dapo controller`: feeds prompts through rollout and reward into `scored`."""

from __future__ import annotations

from services.common.config import DapoConfig
from services.common.lifecycle import announce, stop_event_on_signals
from services.common.redis_server import connect_run
from services.controller.server import create_server


def run(config: DapoConfig) -> None:
    assert config.shared.redis_url
    stop = stop_event_on_signals()
    controller, http = create_server(config, connect_run(config))
    announce("controller", http=http.port)
    try:
        controller.run(stop)
    finally:
        http.stop()
