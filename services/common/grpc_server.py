"""gRPC construction shared by every service: size limits, TLS/mTLS, bearer token, health.

Servers come from `start_grpc_server`, client channels from `channel`; both read the one
`security` config block (services/common/security.py), so no call site handles
credentials itself.

Servicers are added through `StrictServer`, which decodes requests inside the method
instead of in grpc: bytes protobuf cannot parse (truncated, invalid UTF-8 in a string)
get INVALID_ARGUMENT naming the method, not grpc's opaque INTERNAL "Exception
deserializing request!" (tests/test_fuzz_*.py send such bytes to every method).
"""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from typing import Any, NoReturn

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.common.errors import PortInUseError
from services.common.security import (
    AuthConfig,
    SecurityConfig,
    TlsConfig,
    bearer_ok,
    read_pem,
)
from services.common.server_config import ServerConfig

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# gRPC carries a status's details in a header, and a client drops a response whose
# headers pass 16 KiB (RESOURCE_EXHAUSTED, the refusal's words lost): bound ours well below
MAX_DETAILS_CHARS = 2000
UNAUTHENTICATED_MESSAGE = "missing or wrong bearer token (metadata `authorization: Bearer …`)"


def bounded_details(message: str) -> str:
    """A refusal's words, cut to `MAX_DETAILS_CHARS` (a message may quote the request)."""
    if len(message) <= MAX_DETAILS_CHARS:
        return message
    cut = len(message) - MAX_DETAILS_CHARS
    return f"{message[:MAX_DETAILS_CHARS]}… ({cut} more characters cut)"


def abort(context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    """End the call with `code` and bounded details (every servicer aborts through here)."""
    context.abort(code, bounded_details(message))
    raise AssertionError("grpc's abort returned")  # it raises; for the type checker


def grpc_options(max_message_bytes: int) -> list[tuple[str, int | str]]:
    """Channel/server options bounding message sizes in both directions."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


BEHAVIORS = {
    (False, False): "unary_unary",
    (False, True): "unary_stream",
    (True, False): "stream_unary",
    (True, True): "stream_stream",
}


def _decode(decode: Callable[[bytes], Any], data: bytes, context: Any, method: str) -> Any:
    try:
        return decode(data)
    except Exception as exc:  # protobuf raises DecodeError or a runtime-specific error
        abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"cannot decode {method} request: {exc}")


# grpc's (experimental) attributes of a behavior that answers through a callback.
NON_BLOCKING = ("experimental_non_blocking", "experimental_thread_pool")


def strict_handler(handler: Any, method: str) -> Any:
    """The same method handler, decoding its requests itself (INVALID_ARGUMENT if it can't)."""
    decode = None if handler is None else handler.request_deserializer
    if decode is None:
        return handler
    field = BEHAVIORS[(handler.request_streaming, handler.response_streaming)]
    behavior = getattr(handler, field)  # probe-ok: grpc's handler tuple, field by name

    def run(request: Any, context: Any, *callback: Any) -> Any:
        if handler.request_streaming:
            decoded: Iterator[Any] = (_decode(decode, r, context, method) for r in request)
            return behavior(decoded, context, *callback)
        return behavior(_decode(decode, request, context, method), context, *callback)

    for flag in NON_BLOCKING:  # health Watch answers by callback instead of holding a thread
        if hasattr(behavior, flag):  # probe-ok: grpc's optional flags on a behavior
            setattr(run, flag, getattr(behavior, flag))  # probe-ok: the same flag, copied
    return handler._replace(request_deserializer=None, **{field: run})


class _StrictGeneric(grpc.GenericRpcHandler):
    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def service(self, handler_call_details: Any) -> Any:
        handler = self._inner.service(handler_call_details)
        return None if handler is None else strict_handler(handler, handler_call_details.method)


class StrictServer:
    """A grpc.Server seen through which every added method decodes strictly."""

    def __init__(self, server: grpc.Server) -> None:
        self._server = server

    def add_generic_rpc_handlers(self, handlers: Sequence[Any]) -> None:
        self._server.add_generic_rpc_handlers(tuple(_StrictGeneric(h) for h in handlers))

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        strict = {m: strict_handler(h, f"/{service}/{m}") for m, h in handlers.items()}
        self._server.add_registered_method_handlers(service, strict)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server, name)  # probe-ok: __getattr__ delegation to grpc


# ------------------------------------------------------------------------ credentials
def server_credentials(tls: TlsConfig) -> grpc.ServerCredentials:
    """TLS server credentials; under mTLS clients must present a cert signed by `tls.ca`."""
    pair = (read_pem(tls.key, "key"), read_pem(tls.cert, "cert"))
    ca = read_pem(tls.ca, "ca") if tls.mtls else None
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=tls.mtls)


def channel_credentials(tls: TlsConfig) -> grpc.ChannelCredentials:
    """TLS client credentials; under mTLS they carry this process's cert and key."""
    ca = read_pem(tls.ca, "ca") if tls.ca is not None else None
    if not tls.mtls:
        return grpc.ssl_channel_credentials(root_certificates=ca)
    return grpc.ssl_channel_credentials(
        root_certificates=ca,
        private_key=read_pem(tls.key, "key"),
        certificate_chain=read_pem(tls.cert, "cert"),
    )


# ------------------------------------------------------------------------ bearer token
def _denied(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape that answers UNAUTHENTICATED without parsing the request."""

    def deny(request: Any, context: grpc.ServicerContext) -> Any:
        abort(context, grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)

    factories = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    factory = factories[(handler.request_streaming, handler.response_streaming)]
    return factory(deny)


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuses guarded methods (AuthConfig.guards_rpc) without the right bearer token."""

    def __init__(self, auth: AuthConfig, token: str) -> None:
        self._auth, self._token = auth, token

    def intercept_service(self, continuation: Callable, details: Any) -> Any:
        handler = continuation(details)
        if handler is None or not self._auth.guards_rpc(details.method):
            return handler
        header = dict(details.invocation_metadata or ()).get("authorization")
        return handler if bearer_ok(header, self._token) else _denied(handler)


class _CallDetails(
    namedtuple("_CallDetails", "method timeout metadata credentials wait_for_ready compression"),
    grpc.ClientCallDetails,
):
    pass


class BearerToken(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds `authorization: Bearer <token>` to every call of a channel."""

    def __init__(self, token: str) -> None:
        self._header = ("authorization", f"Bearer {token}")

    def _with_token(self, d: Any) -> _CallDetails:
        metadata = [*(d.metadata or ()), self._header]
        return _CallDetails(
            d.method, d.timeout, metadata, d.credentials, d.wait_for_ready, d.compression
        )

    def intercept_unary_unary(self, continuation, details, request):  # noqa: ANN001
        return continuation(self._with_token(details), request)

    intercept_unary_stream = intercept_unary_unary

    def intercept_stream_unary(self, continuation, details, request_iterator):  # noqa: ANN001
        return continuation(self._with_token(details), request_iterator)

    intercept_stream_stream = intercept_stream_unary


# ------------------------------------------------------------------------ servers, channels
class HealthServicer(health.HealthServicer):
    """grpc's health servicer, plus List (grpc's raises NotImplementedError: UNKNOWN) and a
    NOT_FOUND that names the unknown service (grpc's has an empty message)."""

    def __init__(self) -> None:
        super().__init__()
        self._names = {""}  # every service given a status; "" is the server as a whole

    def set(self, service: str, status: Any) -> None:
        self._names.add(service)
        super().set(service, status)

    def Check(self, request: Any, context: Any) -> Any:
        reply = super().Check(request, context)
        if context.code() == grpc.StatusCode.NOT_FOUND:
            context.set_details(f"unknown service {request.service!r}")
        return reply

    def List(self, request: Any, context: Any) -> Any:
        check, ask = super().Check, health_pb2.HealthCheckRequest
        statuses = {name: check(ask(service=name), context) for name in self._names}
        return health_pb2.HealthListResponse(statuses=statuses)


def _bind(server: grpc.Server, address: str, security: SecurityConfig) -> int:
    try:
        if security.tls.enabled:
            return server.add_secure_port(address, server_credentials(security.tls))
        return server.add_insecure_port(address)
    except RuntimeError:
        return 0


def start_grpc_server(
    cfg: ServerConfig,
    add_servicers: Callable[[grpc.Server], None],
    service_names: Sequence[str],
    max_workers: int = 16,
    security: SecurityConfig | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
) -> tuple[grpc.Server, int]:
    """Start a server with the given servicers plus health; return it and its bound port."""
    security = security or SecurityConfig()
    token = security.auth.secret()
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers),
        options=[*grpc_options(max_message_bytes), ("grpc.so_reuseport", 0)],
        interceptors=[TokenInterceptor(security.auth, token)] if token else None,
    )
    add_servicers(StrictServer(server))
    health_servicer = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, StrictServer(server))
    for name in ("", *service_names):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    address = f"{cfg.host}:{cfg.grpc_port}"
    port = _bind(server, address, security)
    if port == 0:
        raise PortInUseError(f"cannot bind gRPC port {address} (in use or not permitted)")
    server.start()
    return server, port


def channel(
    address: str,
    security: SecurityConfig | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
) -> grpc.Channel:
    """A client channel: our size limits, TLS/mTLS and the bearer token as configured."""
    security = security or SecurityConfig()
    tls, options = security.tls, grpc_options(max_message_bytes)
    if tls.enabled:
        if tls.server_name:
            options.append(("grpc.ssl_target_name_override", tls.server_name))
        plain = grpc.secure_channel(address, channel_credentials(tls), options=options)
    else:
        plain = grpc.insecure_channel(address, options=options)
    token = security.auth.secret()
    return grpc.intercept_channel(plain, BearerToken(token)) if token else plain


def insecure_channel(
    address: str, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
) -> grpc.Channel:
    """A plaintext channel with our size limits (tests, local tools)."""
    return channel(address, None, max_message_bytes)
