"""Redis with a password and ACL users: a real redis-server started with requirepass."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
import redis

from services.common.errors import DapoError
from services.common.redis_server import RedisServer, client_kwargs, connect, connect_run
from services.common.security import RedisAuthConfig
from services.tools.config import DapoConfig

PASSWORD = 'pa ss"word'  # a space and a quote: the requirepass directive must quote it
ACL_USERS = (
    "--user",
    "writer",
    "on",
    ">writer-pw",
    "~*",
    "&*",
    "+@all",
    "--user",
    "reader",
    "on",
    ">reader-pw",
    "~*",
    "+@read",
    "+@connection",
)


@pytest.fixture(scope="module")
def locked() -> Iterator[RedisServer]:
    server = RedisServer(password=PASSWORD, extra_args=ACL_USERS).wait_ready()
    yield server
    server.stop()


def test_password_is_required_and_never_echoed(locked: RedisServer) -> None:
    with pytest.raises(DapoError, match="refused") as err:
        connect(locked.url)
    wrong = f"redis://:wrong-pw@127.0.0.1:{locked.port}/0"
    with pytest.raises(DapoError, match="refused") as err:
        connect(wrong)
    assert "wrong-pw" not in str(err.value) and "***" in str(err.value)
    client = connect(locked.url, RedisAuthConfig(password=PASSWORD))
    assert client.set("k", "v") and client.get("k") == b"v"
    quoted = quote(PASSWORD, safe="")
    in_url = connect(f"redis://:{quoted}@127.0.0.1:{locked.port}/0")
    assert in_url.get("k") == b"v"


def test_acl_users_from_config_or_url(locked: RedisServer) -> None:
    writer = connect(locked.url, RedisAuthConfig(username="writer", password="writer-pw"))
    assert writer.xadd("s", {"a": "1"})
    reader = connect(f"redis://reader:reader-pw@127.0.0.1:{locked.port}/0")
    assert reader.xlen("s") >= 1
    with pytest.raises(redis.exceptions.NoPermissionError):
        reader.xadd("s", {"a": "2"})


def test_connect_run_uses_the_security_section(locked: RedisServer, tmp_path: Path) -> None:
    secret = tmp_path / "redis-password"
    secret.write_text(PASSWORD + "\n")
    config = DapoConfig.model_validate(
        {
            "shared": {"redis_url": locked.url},
            "security": {"redis": {"password_file": str(secret)}},
        }
    )
    assert connect_run(config).ping()


def test_tls_files_only_go_to_rediss_urls() -> None:
    auth = RedisAuthConfig(username="u", password="p", ca="/ca.pem", cert="/c.pem", key="/k.pem")
    tls = client_kwargs("rediss://h:6380/0", auth)
    assert tls == {
        "username": "u",
        "password": "p",
        "ssl_ca_certs": "/ca.pem",
        "ssl_certfile": "/c.pem",
        "ssl_keyfile": "/k.pem",
    }
    assert client_kwargs("redis://h:6379/0", auth) == {"username": "u", "password": "p"}
    # redis-py builds an SSL connection pool from these (no TLS-enabled redis-server here).
    pool = redis.Redis.from_url("rediss://h:6380/0", **tls).connection_pool
    assert pool.connection_class is redis.SSLConnection
    assert pool.connection_kwargs["ssl_ca_certs"] == "/ca.pem"
