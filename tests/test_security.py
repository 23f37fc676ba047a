"""gRPC TLS/mTLS, the bearer token (gRPC and HTTP), message-size limits: real servers.

Certificates come from a throw-away CA made per session (tests/pki.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pki import Pki, client_tls, make_pki, server_tls

from dapo.v1 import learner_pb2, learner_pb2_grpc
from learner.weights import WeightServicer, add_weight_service
from services.common.errors import DapoError
from services.common.grpc_server import channel, insecure_channel, start_grpc_server
from services.common.http import create_http_app, serve_http
from services.common.security import (
    AuthConfig,
    SecurityConfig,
    TlsConfig,
    bearer_ok,
    redact_url,
    secret_env,
    without_secrets,
)
from services.common.server_config import ServerConfig
from services.tools.config import DapoConfig, dump_config, load_config
from services.weight_transport.tensor_codec import RawTensor

TOKEN = "s3cret-token"
FETCH = "/dapo.v1.WeightService/FetchWeights"


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def weights(size: int = 16) -> list[RawTensor]:
    return [RawTensor("w", "float32", (size,), b"\0" * 4 * size)]


def serve_weights(security: SecurityConfig, max_bytes: int = 64 * 1024 * 1024):
    """A real WeightService (one tiny tensor published) on a free port."""
    servicer = WeightServicer(bucket_bytes=1 << 20)
    servicer.publish(3, weights())
    return start_grpc_server(
        ServerConfig(),
        lambda s: add_weight_service(servicer, s),
        ["dapo.v1.WeightService"],
        security=security,
        max_message_bytes=max_bytes,
    )


@pytest.fixture
def weight_server(request: pytest.FixtureRequest) -> Iterator[int]:
    server, port = serve_weights(request.param)
    yield port
    server.stop(0)


def healthy(chan: grpc.Channel) -> bool:
    reply = health_pb2_grpc.HealthStub(chan).Check(health_pb2.HealthCheckRequest(), timeout=10)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def fetch(chan: grpc.Channel) -> list[Any]:
    stub = learner_pb2_grpc.WeightServiceStub(chan)
    return list(stub.FetchWeights(learner_pb2.FetchWeightsRequest(), timeout=10))


def code_of(call: Any) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code()


# ---------------------------------------------------------------------------- TLS / mTLS
def test_tls_serves_tls_clients_and_refuses_plaintext(pki: Pki) -> None:
    server, port = serve_weights(SecurityConfig(tls=server_tls(pki)))
    address = f"127.0.0.1:{port}"
    try:
        with channel(address, SecurityConfig(tls=client_tls(pki))) as chan:
            assert healthy(chan) and len(fetch(chan)) == 1
        with channel(f"localhost:{port}", SecurityConfig(tls=client_tls(pki))) as chan:
            assert healthy(chan)
        with insecure_channel(address) as plain:  # plaintext to a TLS port
            assert code_of(lambda: healthy(plain)) == grpc.StatusCode.UNAVAILABLE
        untrusted = SecurityConfig(tls=client_tls(pki, ca=pki.other_ca))
        with channel(address, untrusted) as chan:  # server cert not from the trusted CA
            assert code_of(lambda: healthy(chan)) == grpc.StatusCode.UNAVAILABLE
        with channel(address, SecurityConfig(tls=client_tls(pki))) as chan:
            assert healthy(chan)  # the server survived all of it
    finally:
        server.stop(0)


def test_tls_client_to_a_plaintext_server_fails(pki: Pki) -> None:
    server, port = serve_weights(SecurityConfig())
    try:
        with channel(f"127.0.0.1:{port}", SecurityConfig(tls=client_tls(pki))) as chan:
            assert code_of(lambda: healthy(chan)) == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(0)


def test_server_name_override_verifies_a_shared_name(pki: Pki) -> None:
    server, port = serve_weights(SecurityConfig(tls=server_tls(pki)))
    try:
        good = SecurityConfig(tls=client_tls(pki, server_name="dapo.internal"))
        with channel(f"127.0.0.1:{port}", good) as chan:
            assert healthy(chan)
        wrong = SecurityConfig(tls=client_tls(pki, server_name="elsewhere.example"))
        with channel(f"127.0.0.1:{port}", wrong) as chan:
            assert code_of(lambda: healthy(chan)) == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(0)


def test_mtls_requires_a_client_cert_from_our_ca(pki: Pki) -> None:
    server, port = serve_weights(SecurityConfig(tls=server_tls(pki, mtls=True)))
    address = f"127.0.0.1:{port}"
    try:
        ours = SecurityConfig(tls=client_tls(pki, pki.client, mtls=True))
        with channel(address, ours) as chan:
            assert healthy(chan) and len(fetch(chan)) == 1
        no_cert = SecurityConfig(tls=client_tls(pki))
        with channel(address, no_cert) as chan:
            assert code_of(lambda: healthy(chan)) == grpc.StatusCode.UNAVAILABLE
        foreign = SecurityConfig(tls=client_tls(pki, pki.foreign_client, mtls=True))
        with channel(address, foreign) as chan:
            assert code_of(lambda: healthy(chan)) == grpc.StatusCode.UNAVAILABLE
        with channel(address, ours) as chan:  # still serving
            assert healthy(chan)
    finally:
        server.stop(0)


def test_tls_config_errors_name_the_field(pki: Pki, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tls.mtls needs tls.ca"):
        TlsConfig(enabled=True, mtls=True, cert="c", key="k")
    with pytest.raises(DapoError, match="security.tls.cert must be set"):
        serve_weights(SecurityConfig(tls=TlsConfig(enabled=True, key=str(pki.server.key))))
    missing = str(tmp_path / "nope.pem")
    with pytest.raises(DapoError, match="security.tls.key"):
        serve_weights(SecurityConfig(tls=TlsConfig(enabled=True, cert=missing, key=missing)))


# ---------------------------------------------------------------------------- bearer token
def token_security(scope: str = "admin", token: str = TOKEN) -> SecurityConfig:
    return SecurityConfig(auth=AuthConfig(token=token, scope=scope))


@pytest.mark.parametrize("weight_server", [token_security()], indirect=True)
def test_grpc_token_guards_control_methods_only(weight_server: int) -> None:
    address = f"127.0.0.1:{weight_server}"
    with insecure_channel(address) as anonymous:
        assert healthy(anonymous)  # probes stay open
        version = learner_pb2_grpc.WeightServiceStub(anonymous).GetVersion(
            learner_pb2.GetVersionRequest(), timeout=10
        )
        assert version.version == 3  # not guarded in scope "admin"
        with pytest.raises(grpc.RpcError) as err:
            fetch(anonymous)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "bearer token" in err.value.details()
    with channel(address, token_security(token="wrong")) as wrong:
        assert code_of(lambda: fetch(wrong)) == grpc.StatusCode.UNAUTHENTICATED
    with channel(address, token_security()) as ours:
        assert len(fetch(ours)) == 1


@pytest.mark.parametrize("weight_server", [token_security("all")], indirect=True)
def test_grpc_token_scope_all_guards_every_method_but_health(weight_server: int) -> None:
    address = f"127.0.0.1:{weight_server}"
    request = learner_pb2.GetVersionRequest()
    with insecure_channel(address) as anonymous:
        assert healthy(anonymous)
        stub = learner_pb2_grpc.WeightServiceStub(anonymous)
        assert code_of(lambda: stub.GetVersion(request, timeout=10)).name == "UNAUTHENTICATED"
    with channel(address, token_security()) as ours:
        stub = learner_pb2_grpc.WeightServiceStub(ours)
        assert stub.GetVersion(request, timeout=10).version == 3


def test_http_token_guards_status_and_optionally_metrics(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")  # as a mounted secret often is
    auth = AuthConfig(token_file=str(token_file), protect_metrics=True)
    http = serve_http(create_http_app("svc", status=lambda: {"step": 7}, auth=auth))
    good = {"Authorization": f"Bearer {TOKEN}"}
    try:
        with httpx.Client(base_url=http.url, timeout=10) as client:
            assert client.get("/healthz").status_code == 200
            assert client.get("/readyz").status_code == 200
            for path in ("/status", "/metrics"):
                denied = client.get(path)
                assert denied.status_code == 401
                assert denied.headers["www-authenticate"] == "Bearer"
                bad = client.get(path, headers={"Authorization": "Bearer nope"})
                assert bad.status_code == 401
                assert client.get(path, headers=good).status_code == 200
            assert client.get("/status", headers=good).json()["step"] == 7
    finally:
        http.stop()


def test_http_metrics_open_by_default_and_no_token_means_no_auth() -> None:
    http = serve_http(create_http_app("svc", auth=AuthConfig(token=TOKEN)))
    plain = serve_http(create_http_app("svc", auth=AuthConfig()))
    try:
        assert httpx.get(f"{http.url}/metrics").status_code == 200
        assert httpx.get(f"{http.url}/status").status_code == 401
        assert httpx.get(f"{plain.url}/status").status_code == 200
    finally:
        http.stop()
        plain.stop()


def test_bearer_check() -> None:
    assert bearer_ok(f"Bearer {TOKEN}", TOKEN) and bearer_ok(f"bearer {TOKEN}", TOKEN)
    for header in (None, "", TOKEN, f"Basic {TOKEN}", f"Bearer {TOKEN}x", "Bearer "):
        assert not bearer_ok(header, TOKEN)


# ---------------------------------------------------------------------------- secrets
def test_secrets_are_masked_and_leave_config_files(tmp_path: Path) -> None:
    env = {"DAPO_SECURITY__AUTH__TOKEN": "1e5", "DAPO_SECURITY__REDIS__PASSWORD": "007"}
    config = load_config(env=env)
    # Taken verbatim: YAML parsing would have made these 100000.0 and 7.
    assert config.security.auth.secret() == "1e5"
    assert config.security.redis.secret() == "007"
    assert "1e5" not in dump_config(config) and "1e5" not in repr(config)
    assert secret_env(config.security) == {
        "DAPO_SECURITY__AUTH__TOKEN": "1e5",
        "DAPO_SECURITY__REDIS__PASSWORD": "007",
    }
    stripped = without_secrets(config.security)
    assert stripped.auth.token is None and stripped.redis.password is None
    with_url = load_config(env={"DAPO_SHARED__REDIS_URL": "redis://u:pw-9@h:1/0"})
    assert "pw-9" not in dump_config(with_url) and "u:***@h:1" in dump_config(with_url)
    assert secret_env(with_url.security, with_url.shared.redis_url) == {
        "DAPO_SHARED__REDIS_URL": "redis://u:pw-9@h:1/0"
    }
    assert secret_env(SecurityConfig(), "redis://h:1/0") == {}
    numeric = DapoConfig.model_validate({"security": {"auth": {"token": 12345}}})
    assert numeric.security.auth.secret() == "12345"
    assert redact_url("redis://u:pw@h:6379/0") == "redis://u:***@h:6379/0"
    assert redact_url("rediss://h:6380") == "rediss://h:6380"


# ---------------------------------------------------------------------------- message sizes
def test_weight_service_refuses_oversize_requests_and_stays_healthy() -> None:
    server, port = serve_weights(SecurityConfig(), max_bytes=4096)
    address = f"127.0.0.1:{port}"
    try:
        with insecure_channel(address) as chan:
            raw = chan.unary_stream(FETCH)  # bytes in, bytes out: any size we like
            with pytest.raises(grpc.RpcError) as err:
                list(raw(b"\x08\x01" + b"\x00" * 10_000, timeout=10))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert healthy(chan) and len(fetch(chan)) == 1
    finally:
        server.stop(0)


def test_client_channel_refuses_oversize_replies() -> None:
    servicer = WeightServicer(bucket_bytes=1 << 20)
    servicer.publish(1, weights(size=64 * 1024))  # one 256 KiB bucket
    server, port = start_grpc_server(
        ServerConfig(), lambda s: add_weight_service(servicer, s), ["dapo.v1.WeightService"]
    )
    try:
        with insecure_channel(f"127.0.0.1:{port}", max_message_bytes=64 * 1024) as small:
            assert code_of(lambda: fetch(small)) == grpc.StatusCode.RESOURCE_EXHAUSTED
        with insecure_channel(f"127.0.0.1:{port}") as default:
            assert len(fetch(default)) == 1
    finally:
        server.stop(0)
