"""Fuzzing the learner's WeightService (GetVersion, FetchWeights, OpenWeightSocket) and
its weight socket on real servers.

1000 generated requests per method (random versions and bucket sizes) and 1000 raw byte
strings per method: a fetch streams exactly the published tensors, or ends with a clear
FAILED_PRECONDITION (a version not kept) / INVALID_ARGUMENT (a bucket size below the
smallest served, bytes that do not decode), as the request itself says it must; a weight
socket ticket is redeemed for exactly those tensors. 1000 byte strings sent as a weight
socket connection's first bytes: only a valid, unused ticket gets any byte back.
"""

from __future__ import annotations

import errno
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import grpc
import pytest
from fuzzing import (
    EXAMPLES,
    STRUCTURE_BYTES,
    Counter,
    assert_clear_refusal,
    decodes,
    fuzz,
    raw_call,
    wire_bytes,
)
from hypothesis import strategies as st

from dapo.v1 import learner_pb2, learner_pb2_grpc, tensor_pb2
from learner.weights import WeightServicer, add_weight_service
from services.common.grpc_server import insecure_channel, start_grpc_server
from services.common.security import TlsConfig
from services.common.server_config import ServerConfig
from services.weight_transport import weight_socket
from services.weight_transport.assembly import Assembling, assemble_update
from services.weight_transport.tensor_codec import RawTensor
from services.weight_transport.weight_socket import (
    CONNECTION_THREAD,
    FRAME,
    TICKET_BYTES,
    WeightSocketServer,
)

VERSION = 7
SMALLEST_BUCKET = 16  # the servicer's bucket size: it serves no smaller one
# Small on purpose: a bucket size of 1 byte streams one bucket per byte.
PUBLISHED = [
    RawTensor("a", "float32", (3, 2), bytes(range(24))),
    RawTensor("b", "int8", (5,), b"\x01\x02\x03\x04\x05"),
    RawTensor("empty", "float16", (0, 4), b""),
]
SOCKET_SLOTS = 16  # WeightSocketServer's max_connections


@pytest.fixture(scope="module")
def servicer() -> Iterator[WeightServicer]:
    sock = WeightSocketServer("127.0.0.1", 0, TlsConfig(), max_connections=SOCKET_SLOTS)
    servicer = WeightServicer(bucket_bytes=SMALLEST_BUCKET, weight_socket=sock.start())
    servicer.publish(VERSION, PUBLISHED)
    yield servicer
    servicer.close()


@pytest.fixture(scope="module")
def channel(servicer: WeightServicer) -> Iterator[Any]:
    server, port = start_grpc_server(
        ServerConfig(), lambda s: add_weight_service(servicer, s), ["dapo.v1.WeightService"]
    )
    with insecure_channel(f"127.0.0.1:{port}") as channel:
        yield channel
    server.stop(0)


Outcome = Callable[[], tuple[int, list[RawTensor]]]


def check_verdict(request: learner_pb2.FetchWeightsRequest, outcome: Outcome) -> None:
    """The verdict the request deserves: the published tensors, or a clear refusal."""
    try:
        got_version, tensors = outcome()
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


def check_fetch(channel: Any, request: learner_pb2.FetchWeightsRequest, data: bytes) -> None:
    """FetchWeights with `data` gets what `request` deserves."""
    fetch = channel.unary_stream(
        "/dapo.v1.WeightService/FetchWeights",
        response_deserializer=tensor_pb2.WeightBucket.FromString,
    )
    check_verdict(request, lambda: assemble_update(Assembling(fetch(data, timeout=30))))


def redeem(port: int, ticket: bytes) -> tuple[int, list[RawTensor]]:
    """(version, tensors) a ticket gets on the weight socket, read as rollout servers do."""
    sock = weight_socket.connect("127.0.0.1", port, ticket, TlsConfig(), 30)
    return assemble_update(Assembling.of_frames(weight_socket.read_frames(sock, 1 << 20)))


def check_open(
    channel: Any, port: int, request: learner_pb2.FetchWeightsRequest, data: bytes
) -> None:
    """OpenWeightSocket with `data`: a ticket that redeems for what FetchWeights would
    stream (same version), or the refusal FetchWeights gives."""

    def outcome() -> tuple[int, list[RawTensor]]:
        reply = raw_call(channel, "/dapo.v1.WeightService/OpenWeightSocket", data)
        granted = learner_pb2.WeightSocketTicket.FromString(reply)
        assert len(granted.ticket) == TICKET_BYTES and granted.port == port
        version, tensors = redeem(granted.port, granted.ticket)
        assert granted.version == version
        return version, tensors

    check_verdict(request, outcome)


FETCH_REQUESTS = st.builds(
    learner_pb2.FetchWeightsRequest,
    version=st.one_of(st.sampled_from([0, VERSION]), st.integers(0, 2**64 - 1)),
    bucket_bytes=st.one_of(st.integers(0, 64), st.integers(0, 2**64 - 1)),
)
RAW_MESSAGES = {
    "GetVersion": st.one_of(FETCH_REQUESTS, st.just(learner_pb2.GetVersionRequest())),
    "FetchWeights": FETCH_REQUESTS,
    "OpenWeightSocket": FETCH_REQUESTS,
}


def test_fuzz_fetch_weights(channel: Any) -> None:

    def check(request: learner_pb2.FetchWeightsRequest) -> None:
        check_fetch(channel, request, request.SerializeToString())

    fuzz(check, request=FETCH_REQUESTS)


def test_fuzz_open_weight_socket(channel: Any, servicer: WeightServicer) -> None:
    """Every ticket granted is redeemed over the socket."""
    port = servicer.weight_socket.port

    def check(request: learner_pb2.FetchWeightsRequest) -> None:
        check_open(channel, port, request, request.SerializeToString())

    fuzz(check, request=FETCH_REQUESTS)


def test_fuzz_get_version(channel: Any) -> None:
    """GetVersionRequest has no fields: generated ones carry unknown fields (other messages)."""
    stub = learner_pb2_grpc.WeightServiceStub(channel)
    unknown = st.one_of(FETCH_REQUESTS, st.builds(learner_pb2.GetVersionResponse))

    def check(other: Any) -> None:
        request = learner_pb2.GetVersionRequest.FromString(other.SerializeToString())
        assert stub.GetVersion(request, timeout=30).version == VERSION

    fuzz(check, other=unknown)


@pytest.mark.parametrize("kind", ["raw", "structure"])
@pytest.mark.parametrize("method", RAW_MESSAGES)
def test_fuzz_raw_bytes(channel: Any, servicer: WeightServicer, method: str, kind: str) -> None:
    """Bytes that decode get the decoded request's verdict; others INVALID_ARGUMENT.
    `structure`: another RPC's message, nested unknown groups, a huge unknown field."""
    port = servicer.weight_socket.port
    request_type = learner_pb2.GetVersionRequest
    if method != "GetVersion":
        request_type = learner_pb2.FetchWeightsRequest
    path = f"/dapo.v1.WeightService/{method}"

    def check(data: bytes) -> None:
        if method != "GetVersion" and decodes(request_type, data):
            request = request_type.FromString(data)
            if method == "FetchWeights":
                check_fetch(channel, request, data)
            else:
                check_open(channel, port, request, data)
            return
        try:
            if method == "FetchWeights":
                list(channel.unary_stream(path)(data, timeout=30))
            reply = raw_call(channel, path, data)
        except grpc.RpcError as exc:
            assert_clear_refusal(exc)
            assert not decodes(request_type, data) and "cannot decode" in exc.details()
            return
        assert method == "GetVersion" and decodes(request_type, data)
        assert learner_pb2.GetVersionResponse.FromString(reply).version == VERSION

    fuzz(check, data=wire_bytes(RAW_MESSAGES[method]) if kind == "raw" else STRUCTURE_BYTES)


# ------------------------------------------------------------------ the raw weight socket
# What a connection sends first, as (kind, argument); the ticket is issued per case.
FIRST_BYTES = st.one_of(
    st.tuples(st.just("random"), st.binary(max_size=100)),
    st.tuples(st.just("random"), st.binary(min_size=TICKET_BYTES, max_size=TICKET_BYTES)),
    st.tuples(st.just("prefix"), st.integers(0, TICKET_BYTES - 1)),
    st.tuples(st.just("flipped"), st.integers(0, TICKET_BYTES - 1)),
    st.tuples(st.just("valid"), st.binary(max_size=100 - TICKET_BYTES)),
    st.tuples(st.just("used"), st.binary(max_size=100 - TICKET_BYTES)),
)


def first_bytes(kind: str, arg: Any, ticket: bytes) -> bytes:
    """The bytes a case sends, given a freshly issued (still unused) `ticket`."""
    if kind == "random":
        return arg
    if kind == "prefix":
        return ticket[:arg]
    if kind == "flipped":
        return ticket[:arg] + bytes([ticket[arg] ^ 0x5A]) + ticket[arg + 1 :]
    return ticket + arg  # valid or used: the ticket, then junk (maybe none)


def send_and_read(port: int, data: bytes) -> bytes:
    """Send `data`, half-close, and read until the server closes: all it sent. (A refused
    connection with input left unread is reset rather than closed, maybe while we send.)"""
    got = bytearray()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
            while chunk := sock.recv(1 << 16):
                got += chunk
        except OSError as exc:  # a timeout (errno None) is a failure
            if exc.errno not in (errno.ECONNRESET, errno.ENOTCONN, errno.EPIPE):
                raise
    return bytes(got)


def stream_bytes(frames: Iterable[list[bytes | memoryview]]) -> bytes:
    """What the socket sends for a ticket to `frames` (each a list of parts): the joined
    frames, length-prefixed, then 0."""
    joined = [b"".join(parts) for parts in frames]
    return b"".join(FRAME.pack(len(f)) + f for f in joined) + FRAME.pack(0)


def serving_threads() -> int:
    return sum(t.name == CONNECTION_THREAD for t in threading.enumerate())


def wait_idle(deadline_s: float = 5.0) -> int:
    """Connection threads still running once they had `deadline_s` to finish."""
    end = time.monotonic() + deadline_s
    while serving_threads() and time.monotonic() < end:
        time.sleep(0.01)
    return serving_threads()


def test_fuzz_weight_socket_first_bytes(servicer: WeightServicer) -> None:
    """Only a valid, unused ticket (junk after it is ignored) gets bytes back; the rest
    get the connection closed with nothing sent. The server stays up and frees each
    connection's thread and slot: all 16 slots serve at once afterwards, a 17th is shut."""
    sock_server = servicer.weight_socket
    port, frames = sock_server.port, servicer._buckets(learner_pb2.FetchWeightsRequest(), None)
    kinds = Counter()

    def check(case: tuple[str, Any]) -> None:
        kind, arg = case
        ticket = sock_server.issue(frames)
        if kind == "used":
            assert redeem(port, ticket)[0] == VERSION
        data = first_bytes(kind, arg, ticket)
        rightful = kind == "valid" or (kind == "random" and data[:TICKET_BYTES] == ticket)
        kinds.n += rightful
        assert send_and_read(port, data) == (stream_bytes(frames) if rightful else b"")

    fuzz(check, case=FIRST_BYTES)
    assert kinds.n > EXAMPLES // 20
    assert wait_idle() == 0
    # Every slot is free: SOCKET_SLOTS connections held open at once all get served.
    held = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(SOCKET_SLOTS)]
    try:
        end = time.monotonic() + 5
        while serving_threads() < SOCKET_SLOTS and time.monotonic() < end:
            time.sleep(0.01)
        assert serving_threads() == SOCKET_SLOTS  # each held connection has its thread
        assert send_and_read(port, sock_server.issue(frames)) == b""  # no slot left for it
        for sock in held:
            sock.sendall(sock_server.issue(frames))
        for sock in held:
            version, tensors = assemble_update(
                Assembling.of_frames(weight_socket.read_frames(sock, 1 << 20))
            )
            assert version == VERSION and len(tensors) == len(PUBLISHED)
    finally:
        for sock in held:
            sock.close()
    assert wait_idle() == 0
    for _ in range(SOCKET_SLOTS + 4):  # and one after another, as rollout servers do
        assert redeem(port, sock_server.issue(frames))[0] == VERSION
