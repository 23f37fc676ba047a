"""`dapo buffer`: the dynamic-sampling filter service."""

from __future__ import annotations

from services.buffer.server import create_server
from services.common.config import DapoConfig
from services.common.lifecycle import announce, stop_event_on_signals
from services.common.redis_server import connect_run


def run(config: DapoConfig) -> None:
    assert config.shared.redis_url
    stop = stop_event_on_signals()
    buffer, http = create_server(config, connect_run(config))
    announce("buffer", http=http.port)
    try:
        buffer.run(stop)
    finally:
        http.stop()
