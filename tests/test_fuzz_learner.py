"""Fuzzing the learner's WeightService (GetVersion, FetchWeights) on a real server.

Random versions and bucket sizes, and raw bytes: a fetch streams exactly the published
tensors, or ends with a clear FAILED_PRECONDITION / INVALID_ARGUMENT.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from fuzzing import Counter, assert_clear_refusal, cases, raw_call
from hypothesis import given
from hypothesis import strategies as st

from dapo.v1 import learner_pb2, learner_pb2_grpc
from learner.weights import WeightServicer, add_weight_service
from services.common.grpc_server import insecure_channel, start_grpc_server
from services.common.server_config import ServerConfig
from services.common.tensor_codec import RawTensor, assemble_update

VERSION = 7
# Small on purpose: a bucket size of 1 byte streams one bucket per byte.
PUBLISHED = [
    RawTensor("a", "float32", (3, 2), bytes(range(24))),
    RawTensor("b", "int8", (5,), b"\x01\x02\x03\x04\x05"),
    RawTensor("empty", "float16", (0, 4), b""),
]


@pytest.fixture(scope="module")
def channel() -> Iterator[Any]:
    servicer = WeightServicer(bucket_bytes=16)
    servicer.publish(VERSION, PUBLISHED)
    server, port = start_grpc_server(
        ServerConfig(), lambda s: add_weight_service(servicer, s), ["dapo.v1.WeightService"]
    )
    with insecure_channel(f"127.0.0.1:{port}") as channel:
        yield channel
    server.stop(0)


def test_fuzz_fetch_weights(channel: Any) -> None:
    stub = learner_pb2_grpc.WeightServiceStub(channel)
    seen = Counter()

    @cases(300)
    @given(
        version=st.one_of(st.sampled_from([0, VERSION]), st.integers(0, 2**64 - 1)),
        bucket_bytes=st.one_of(st.integers(0, 64), st.integers(0, 2**64 - 1)),
    )
    def run(version: int, bucket_bytes: int) -> None:
        seen()
        request = learner_pb2.FetchWeightsRequest(version=version, bucket_bytes=bucket_bytes)
        try:
            got_version, tensors = assemble_update(stub.FetchWeights(request, timeout=30))
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:  # below the smallest bucket
                assert_clear_refusal(exc)
                assert 0 < bucket_bytes < 16
                return
            assert_clear_refusal(exc, grpc.StatusCode.FAILED_PRECONDITION)
            assert version not in (0, VERSION)
            return
        assert version in (0, VERSION) and got_version == VERSION
        assert [(t.name, t.dtype, t.shape, bytes(t.data)) for t in tensors] == [
            (t.name, t.dtype, t.shape, bytes(t.data)) for t in PUBLISHED
        ]

    run()
    assert seen.n >= 300
    assert stub.GetVersion(learner_pb2.GetVersionRequest(), timeout=10).version == VERSION


def test_fuzz_raw_bytes(channel: Any) -> None:
    seen = Counter()

    @cases(300)
    @given(method=st.sampled_from(["GetVersion", "FetchWeights"]), data=st.binary(max_size=32))
    def run(method: str, data: bytes) -> None:
        seen()
        path = f"/dapo.v1.WeightService/{method}"
        try:
            if method == "GetVersion":
                reply = learner_pb2.GetVersionResponse.FromString(raw_call(channel, path, data))
                assert reply.version == VERSION
            else:
                list(channel.unary_stream(path)(data, timeout=30))
        except grpc.RpcError as exc:
            codes = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)
            assert_clear_refusal(exc, *codes)

    run()
    assert seen.n >= 300
