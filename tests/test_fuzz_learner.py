"""Fuzzing the learner's WeightService (GetVersion, FetchWeights) on a real server.

1000 generated requests per method (random versions and bucket sizes) and 1000 raw byte
strings per method: a fetch streams exactly the published tensors, or ends with a clear
FAILED_PRECONDITION (a version not kept) / INVALID_ARGUMENT (a bucket size below the
smallest served, bytes that do not decode), as the request itself says it must.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from fuzzing import EXAMPLES, Counter, assert_clear_refusal, cases, decodes, raw_call, wire_bytes
from hypothesis import given
from hypothesis import strategies as st

from dapo.v1 import learner_pb2, learner_pb2_grpc, tensor_pb2
from learner.weights import WeightServicer, add_weight_service
from services.common.grpc_server import insecure_channel, start_grpc_server
from services.common.server_config import ServerConfig
from services.common.tensor_codec import RawTensor, assemble_update

VERSION = 7
SMALLEST_BUCKET = 16  # the servicer's bucket size: it serves no smaller one
# Small on purpose: a bucket size of 1 byte streams one bucket per byte.
PUBLISHED = [
    RawTensor("a", "float32", (3, 2), bytes(range(24))),
    RawTensor("b", "int8", (5,), b"\x01\x02\x03\x04\x05"),
    RawTensor("empty", "float16", (0, 4), b""),
]


@pytest.fixture(scope="module")
def channel() -> Iterator[Any]:
    servicer = WeightServicer(bucket_bytes=SMALLEST_BUCKET)
    servicer.publish(VERSION, PUBLISHED)
    server, port = start_grpc_server(
        ServerConfig(), lambda s: add_weight_service(servicer, s), ["dapo.v1.WeightService"]
    )
    with insecure_channel(f"127.0.0.1:{port}") as channel:
        yield channel
    server.stop(0)


def check_fetch(channel: Any, request: learner_pb2.FetchWeightsRequest, data: bytes) -> None:
    """The verdict the request deserves: the published tensors, or a clear refusal."""
    fetch = channel.unary_stream(
        "/dapo.v1.WeightService/FetchWeights",
        response_deserializer=tensor_pb2.WeightBucket.FromString,
    )
    try:
        got_version, tensors = assemble_update(fetch(data, timeout=30))
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:  # below the smallest bucket
            assert_clear_refusal(exc)
            assert 0 < request.bucket_bytes < SMALLEST_BUCKET and "bucket_bytes" in exc.details()
            return
        assert_clear_refusal(exc, grpc.StatusCode.FAILED_PRECONDITION)
        assert request.version not in (0, VERSION) and "not available" in exc.details()
        return
    assert request.version in (0, VERSION) and got_version == VERSION
    assert [(t.name, t.dtype, t.shape, bytes(t.data)) for t in tensors] == [
        (t.name, t.dtype, t.shape, bytes(t.data)) for t in PUBLISHED
    ]


FETCH_REQUESTS = st.builds(
    learner_pb2.FetchWeightsRequest,
    version=st.one_of(st.sampled_from([0, VERSION]), st.integers(0, 2**64 - 1)),
    bucket_bytes=st.one_of(st.integers(0, 64), st.integers(0, 2**64 - 1)),
)
RAW_MESSAGES = {
    "GetVersion": st.one_of(FETCH_REQUESTS, st.just(learner_pb2.GetVersionRequest())),
    "FetchWeights": FETCH_REQUESTS,
}


def test_fuzz_fetch_weights(channel: Any) -> None:
    seen = Counter()

    @cases(EXAMPLES)
    @given(request=FETCH_REQUESTS)
    def run(request: learner_pb2.FetchWeightsRequest) -> None:
        seen()
        check_fetch(channel, request, request.SerializeToString())

    run()
    assert seen.n >= EXAMPLES


def test_fuzz_get_version(channel: Any) -> None:
    """GetVersionRequest has no fields: generated ones carry unknown fields (other messages)."""
    stub = learner_pb2_grpc.WeightServiceStub(channel)
    seen = Counter()
    unknown = st.one_of(FETCH_REQUESTS, st.builds(learner_pb2.GetVersionResponse))

    @cases(EXAMPLES)
    @given(other=unknown)
    def run(other: Any) -> None:
        seen()
        request = learner_pb2.GetVersionRequest.FromString(other.SerializeToString())
        assert stub.GetVersion(request, timeout=30).version == VERSION

    run()
    assert seen.n >= EXAMPLES


@pytest.mark.parametrize("method", RAW_MESSAGES)
def test_fuzz_raw_bytes(channel: Any, method: str) -> None:
    """Bytes that decode get the decoded request's verdict; others INVALID_ARGUMENT."""
    seen = Counter()
    request_type = {
        "GetVersion": learner_pb2.GetVersionRequest,
        "FetchWeights": learner_pb2.FetchWeightsRequest,
    }[method]

    @cases(EXAMPLES)
    @given(data=wire_bytes(RAW_MESSAGES[method]))
    def run(data: bytes) -> None:
        seen()
        if method == "FetchWeights" and decodes(request_type, data):
            check_fetch(channel, request_type.FromString(data), data)
            return
        try:
            if method == "FetchWeights":
                list(channel.unary_stream("/dapo.v1.WeightService/FetchWeights")(data, timeout=30))
            reply = raw_call(channel, "/dapo.v1.WeightService/GetVersion", data)
        except grpc.RpcError as exc:
            assert_clear_refusal(exc)
            assert not decodes(request_type, data) and "cannot decode" in exc.details()
            return
        assert method == "GetVersion" and decodes(request_type, data)
        assert learner_pb2.GetVersionResponse.FromString(reply).version == VERSION

    run()
    assert seen.n >= EXAMPLES
