"""Fuzzing the standard grpc.health.v1 service every dapo server carries (Check, List, Watch).

1000 inputs per method: requests for known or random service names, sent whole, spoiled
(cut, a byte changed, junk inserted) or as random bytes. Bytes that do not decode get
INVALID_ARGUMENT naming the method (grpc's own health servicer answered INTERNAL); an
unknown service gets NOT_FOUND naming it (grpc's answered with an empty message).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from fuzzing import (
    STRUCTURE_BYTES,
    assert_clear_refusal,
    decodes,
    fuzz,
    raw_call,
    wire_bytes,
)
from grpc_health.v1 import health_pb2
from hypothesis import strategies as st

from learner.weights import WeightServicer, add_weight_service
from services.common.grpc_server import insecure_channel, start_grpc_server
from services.common.server_config import ServerConfig

SERVICE = "dapo.v1.WeightService"
KNOWN = ["", SERVICE]  # "" is the server as a whole
SERVING = health_pb2.HealthCheckResponse.SERVING
NAMES = st.one_of(st.sampled_from([*KNOWN, "dapo.v1.Nope"]), st.text(max_size=24))
REQUESTS = {
    "Check": st.builds(health_pb2.HealthCheckRequest, service=NAMES),
    "Watch": st.builds(health_pb2.HealthCheckRequest, service=NAMES),
    "List": st.one_of(
        st.just(health_pb2.HealthListRequest()),
        st.builds(health_pb2.HealthCheckRequest, service=NAMES),  # unknown fields to List
    ),
}
REQUEST_TYPES = {
    "Check": health_pb2.HealthCheckRequest,
    "Watch": health_pb2.HealthCheckRequest,
    "List": health_pb2.HealthListRequest,
}


@pytest.fixture(scope="module")
def channel() -> Iterator[Any]:
    servicer = WeightServicer(bucket_bytes=1024)
    server, port = start_grpc_server(
        ServerConfig(), lambda s: add_weight_service(servicer, s), [SERVICE]
    )
    with insecure_channel(f"127.0.0.1:{port}") as channel:
        yield channel
    server.stop(0)


def answer(channel: Any, method: str, data: bytes) -> Any:
    """The decoded reply (Watch: its first message, then the stream is cancelled)."""
    path = f"/grpc.health.v1.Health/{method}"
    if method == "List":
        return health_pb2.HealthListResponse.FromString(raw_call(channel, path, data))
    if method == "Check":
        return health_pb2.HealthCheckResponse.FromString(raw_call(channel, path, data))
    stream = channel.unary_stream(path)(data, timeout=30)
    try:
        return health_pb2.HealthCheckResponse.FromString(next(stream))
    finally:
        stream.cancel()


def check_reply(method: str, request: Any, reply: Any) -> None:
    if method == "List":
        assert {k: v.status for k, v in reply.statuses.items()} == dict.fromkeys(KNOWN, SERVING)
    elif method == "Watch" and request.service not in KNOWN:
        assert reply.status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
    else:
        assert request.service in KNOWN and reply.status == SERVING


@pytest.mark.parametrize("kind", ["raw", "structure"])
@pytest.mark.parametrize("method", REQUESTS)
def test_fuzz_health(channel: Any, method: str, kind: str) -> None:
    """`structure`: another RPC's message, nested unknown groups, a huge unknown field."""
    request_type = REQUEST_TYPES[method]
    whole = REQUESTS[method].map(lambda m: m.SerializeToString())
    raw = st.one_of(whole, wire_bytes(REQUESTS[method]))

    def check(data: bytes) -> None:
        try:
            reply = answer(channel, method, data)
        except grpc.RpcError as exc:
            assert_clear_refusal(exc, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                service = request_type.FromString(data).service
                assert method == "Check" and service not in KNOWN
                assert repr(service) in exc.details()
            else:
                assert not decodes(request_type, data) and method in exc.details()
            return
        check_reply(method, request_type.FromString(data), reply)

    fuzz(check, data=raw if kind == "raw" else STRUCTURE_BYTES)
