"""rediss:// end to end: a real redis-server with a password behind tests/tls_proxy.py.

The bundled redis-server has no TLS, so the proxy terminates it, as stunnel would. Every
client comes from `connect`, as in the services.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from dapo_cli import DAPO
from learner_fixtures import make_groups
from pki import Pki, make_pki
from tls_proxy import TlsProxy

from services.common.adapters import encode_group
from services.common.errors import DapoError
from services.common.keys import RunKeys
from services.common.ledger import read_ledger
from services.common.redis_server import RedisServer, connect
from services.common.security import RedisAuthConfig, SecurityError
from services.tools.cli import main as dapo

PASSWORD = "tls-redis-pw-41c7"
FAST_S = 3.0  # a refused handshake is a DapoError well within this, never a 20 s retry


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def locked() -> Iterator[RedisServer]:
    server = RedisServer(password=PASSWORD).wait_ready()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tls(locked: RedisServer, pki: Pki) -> Iterator[TlsProxy]:
    """Server-authenticated TLS: any client that trusts `pki.ca` may connect."""
    with TlsProxy(locked.port, pki.server) as proxy:
        yield proxy


@pytest.fixture(scope="module")
def mtls(locked: RedisServer, pki: Pki) -> Iterator[TlsProxy]:
    """Mutual TLS: clients must present a certificate signed by `pki.ca`."""
    with TlsProxy(locked.port, pki.server, client_ca=pki.ca) as proxy:
        yield proxy


def client_auth(pki: Pki, password: str | None = PASSWORD, **files: object) -> RedisAuthConfig:
    """The CA-verified client config with the client cert, `files` overriding ca/cert/key."""
    paths = {"ca": pki.ca, "cert": pki.client.cert, "key": pki.client.key, **files}
    return RedisAuthConfig(
        password=password, **{k: str(v) for k, v in paths.items() if v is not None}
    )


def refused_fast(url: str, auth: RedisAuthConfig, match: str) -> str:
    """connect() fails with a DapoError matching `match` in under FAST_S; its message."""
    start = time.monotonic()
    with pytest.raises(DapoError, match=match) as err:
        connect(url, auth)
    assert time.monotonic() - start < FAST_S
    return str(err.value)


def test_tls_with_ca_verification_carries_strings_and_streams(tls: TlsProxy, pki: Pki) -> None:
    served = tls.served
    client = connect(tls.url, client_auth(pki, cert=None, key=None))
    assert client.set("tls:k", "v") and client.get("tls:k") == b"v"
    client.xgroup_create("tls:s", "g", id="0", mkstream=True)
    entry = client.xadd("tls:s", {"n": "1"})
    [[stream, [(got, fields)]]] = client.xreadgroup("g", "c", {"tls:s": ">"}, count=1)
    assert (stream, got, fields) == (b"tls:s", entry, {b"n": b"1"})
    assert client.xack("tls:s", "g", entry) == 1
    assert tls.served > served  # the bytes went through the TLS handshake, not around it


def test_mtls_takes_a_client_cert_signed_by_the_ca(mtls: TlsProxy, pki: Pki) -> None:
    client = connect(mtls.url, client_auth(pki))
    assert client.set("mtls:k", "v") and client.get("mtls:k") == b"v"


@pytest.mark.parametrize("who", ["no client cert", "cert from another CA"])
def test_mtls_refuses_other_clients_fast_and_clearly(mtls: TlsProxy, pki: Pki, who: str) -> None:
    files = {"cert": None, "key": None}
    if who == "cert from another CA":
        files = {"cert": pki.foreign_client.cert, "key": pki.foreign_client.key}
    refused = len(mtls.refused)
    for _ in range(3):  # the alert can race the client's first write: it must not matter
        message = refused_fast(mtls.url, client_auth(pki, **files), "TLS with Redis at rediss://")
        assert "security.redis.cert/key" in message and PASSWORD not in message
    assert len(mtls.refused) > refused  # the server side refused the handshake


def test_untrusted_server_cert_fails_fast(tls: TlsProxy, pki: Pki) -> None:
    for ca in (pki.other_ca, None):  # another CA, or the system roots
        auth = client_auth(pki, ca=ca)
        message = refused_fast(tls.url, auth, "certificate verify failed")
        assert "security.redis.ca" in message


def test_wrong_password_over_tls_is_refused_and_redacted(tls: TlsProxy, pki: Pki) -> None:
    url = f"rediss://:wrong-pw-9d1@127.0.0.1:{tls.port}/0"
    message = refused_fast(url, client_auth(pki, password=None), "refused")
    assert "wrong-pw-9d1" not in message and "***" in message
    message = refused_fast(tls.url, client_auth(pki, password="wrong-pw-9d1"), "refused")
    assert "wrong-pw-9d1" not in message


def test_missing_tls_file_names_the_field(tls: TlsProxy, pki: Pki, tmp_path: Path) -> None:
    with pytest.raises(SecurityError, match=r"security\.redis\.cert .*nope\.crt"):
        connect(tls.url, client_auth(pki, cert=tmp_path / "nope.crt"))


def test_tls_connection_loss_is_ridden_out(locked: RedisServer, pki: Pki) -> None:
    """The proxy goes away for a second: the next command waits and succeeds (an outage)."""
    proxy = TlsProxy(locked.port, pki.server, client_ca=pki.ca)
    client = connect(proxy.url, client_auth(pki))
    assert client.set("loss:k", "before")
    proxy.stop()  # the open TLS connection ends without close_notify
    restarted: list[TlsProxy] = []
    again = threading.Timer(
        1.0, lambda: restarted.append(TlsProxy(locked.port, pki.server, pki.ca, proxy.port))
    )
    again.start()
    try:
        start = time.monotonic()
        assert client.get("loss:k") == b"before"
        assert time.monotonic() - start >= 0.9 and restarted
    finally:
        again.join()
        for new_proxy in restarted:
            new_proxy.stop()


def buffer_config(path: Path, proxy: TlsProxy, pki: Pki) -> Path:
    """A config file as an operator writes it: rediss URL, the TLS files, no password."""
    auth = {"ca": str(pki.ca), "cert": str(pki.client.cert), "key": str(pki.client.key)}
    config = {
        "shared": {"redis_url": proxy.url, "run_name": "tls-buffer", "group_size": 4},
        "security": {"redis": auth},
    }
    path.write_text(yaml.safe_dump(config))
    return path


def test_buffer_service_and_ledger_over_mtls(
    mtls: TlsProxy, pki: Pki, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """`dapo buffer` filters a run's groups and `dapo ledger` reads them, all through mTLS."""
    monkeypatch.setenv("DAPO_SECURITY__REDIS__PASSWORD", PASSWORD)  # as `dapo up` hands it on
    config = buffer_config(tmp_path / "config.yaml", mtls, pki)
    client, keys = connect(mtls.url, client_auth(pki)), RunKeys("tls-buffer")
    groups = make_groups(n_groups=3)  # mixed rewards: informative
    solved = [replace(s, reward=1.0, correct=True) for s in groups[2].samples]
    for group in [*groups[:2], replace(groups[2], samples=solved)]:
        client.hincrby(keys.ledger, "admitted", 1)
        client.hincrby(keys.ledger, "scored", 1)
        client.xadd(keys.scored, {"group": encode_group(group)})
    proc = subprocess.Popen(
        [*DAPO, "buffer", "--config", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while read_ledger(client, "tls-buffer").pending_scored and proc.poll() is None:
            assert time.monotonic() < deadline, "the buffer did not process the groups"
            time.sleep(0.1)
        client.set(keys.done, 1)
        output, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, output[-2000:]
    assert PASSWORD not in output
    capsys.readouterr()
    assert dapo(["ledger", "--config", str(config), "--json"]) == 0
    ledger = json.loads(capsys.readouterr().out)
    assert ledger["ok"] and ledger["kept"] == 2 and ledger["filtered"] == {"all_correct": 1}
    assert client.xlen(keys.train) == 2
