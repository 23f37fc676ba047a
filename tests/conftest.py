"""Shared fixtures: a real redis-server on a free port, a tiny model built locally."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from services.common.redis_server import RedisServer, start_redis


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = start_redis()
    yield server
    server.stop()


@pytest.fixture
def redis_client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    yield client
    client.close()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from learner.init_model import init_model

    return init_model(tmp_path_factory.mktemp("tiny-model"), preset="tiny", seed=0)
