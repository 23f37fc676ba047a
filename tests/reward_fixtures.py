"""Shared by the reward service tests: a real reward server on free ports."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from reward.server import RewardServer, create_server
from services.tools.config import DapoConfig


@contextmanager
def reward_server(max_items: int, **reward: object) -> Iterator[RewardServer]:
    """A started reward service with two verifier workers, ready: responses of at most
    100 tokens with a 20-token overlong buffer, `max_items` items per Score, the
    `reward` settings on top."""
    shared = {
        "max_response_length": 100,
        "overlong_buffer_length": 20,
        "rpc": {"max_score_items": max_items},
    }
    ports = {"grpc_port": 0, "http_port": 0}
    reward_config = {"num_workers": 2, **reward, "server": ports}
    config = DapoConfig.model_validate({"shared": shared, "reward": reward_config})
    server = create_server(config).start()
    try:
        assert server.scorer.pool.wait_ready(60), "verifier workers did not start"
        yield server
    finally:
        server.stop()
