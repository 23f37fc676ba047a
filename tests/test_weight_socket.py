"""The weights' data plane: tickets over gRPC, bytes over a plain or TLS TCP socket.

A real WeightService and WeightSocketServer on free loopback ports; the client is the
rollout server's own (`rollout.weights.fetch_update` / `socket_buckets`).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from pki import Pki, make_pki

from dapo.v1 import learner_pb2
from learner.weights import WeightServicer, add_weight_service
from rollout.weights import WeightStub, fetch_update
from services.common.grpc_server import channel, start_grpc_server
from services.common.security import AuthConfig, SecurityConfig, TlsConfig
from services.common.server_config import ServerConfig
from services.tools.config import DapoConfig
from services.weight_transport import weight_socket
from services.weight_transport.assembly import Assembling, assemble_update
from services.weight_transport.tensor_codec import RawTensor
from services.weight_transport.weight_socket import WeightSocketError, WeightSocketServer

VERSION = 5
BUCKET = 4096
# Spans several buckets, with a tensor cut across two of them and an empty one.
PUBLISHED = [
    RawTensor("a", "float32", (1000, 3), bytes(range(250)) * 48),
    RawTensor("b", "int8", (5,), b"\x01\x02\x03\x04\x05"),
    RawTensor("empty", "bfloat16", (0, 4), b""),
]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


class Learnerish:
    """The learner's weight side: WeightService + weight socket, one version published."""

    def __init__(self, security: SecurityConfig, socket_tls: TlsConfig | None = None) -> None:
        tls = socket_tls if socket_tls is not None else security.tls
        self.socket = WeightSocketServer("127.0.0.1", 0, tls, ticket_ttl_s=2.0).start()
        self.servicer = WeightServicer(BUCKET, self.socket)
        self.servicer.publish(VERSION, PUBLISHED)
        self.server, port = start_grpc_server(
            ServerConfig(),
            lambda s: add_weight_service(self.servicer, s),
            ["dapo.v1.WeightService"],
            security=security,
        )
        self.address = f"127.0.0.1:{port}"

    def close(self) -> None:
        self.server.stop(0)
        self.socket.stop()


@pytest.fixture
def plain() -> Iterator[Learnerish]:
    learner = Learnerish(SecurityConfig())
    yield learner
    learner.close()


def as_tuples(tensors: list[RawTensor]) -> list[tuple[Any, ...]]:
    return [(t.name, t.dtype, tuple(t.shape), bytes(t.data)) for t in tensors]


def pull(learner: Learnerish, security: SecurityConfig | None = None) -> tuple[str, list[Any]]:
    config = DapoConfig().model_copy(update={"security": security or SecurityConfig()})
    with channel(learner.address, config.security) as chan:
        transport, (version, tensors) = fetch_update(WeightStub(chan), learner.address, config)
    assert version == VERSION
    return transport, as_tuples(tensors)


def ticket(learner: Learnerish) -> learner_pb2.WeightSocketTicket:
    with channel(learner.address) as chan:
        return WeightStub(chan).OpenWeightSocket(learner_pb2.FetchWeightsRequest(), timeout=10)


def read_all(sock: socket.socket, max_frame: int = 1 << 20) -> list[bytes]:
    return [bytes(f) for f in weight_socket.read_frames(sock, max_frame)]


def redeem(granted: learner_pb2.WeightSocketTicket, tls: TlsConfig | None = None) -> list[bytes]:
    """Connect with `granted`'s ticket (TLS as given) and read every frame."""
    ticket = granted.ticket
    return read_all(
        weight_socket.connect("127.0.0.1", granted.port, ticket, tls or TlsConfig(), 10)
    )


def test_a_fetch_over_the_socket_is_bitwise_the_published_weights(plain: Learnerish) -> None:
    transport, tensors = pull(plain)
    assert transport == "weight socket" and tensors == as_tuples(PUBLISHED)
    granted = ticket(plain)
    assert granted.version == VERSION and granted.port == plain.socket.port
    sock = weight_socket.connect("127.0.0.1", granted.port, granted.ticket, TlsConfig(), 10)
    published = plain.servicer._buckets(learner_pb2.FetchWeightsRequest(), None)
    assert read_all(sock) == [b"".join(parts) for parts in published]


def _publishing(learner: Learnerish, tensors: Iterator[RawTensor]) -> threading.Thread:
    """Publish VERSION + 1 from `tensors` on a thread; return once it is offered."""
    thread = threading.Thread(
        target=learner.servicer.publish, args=(VERSION + 1, tensors, len(PUBLISHED)), daemon=True
    )
    thread.start()
    deadline = time.monotonic() + 10
    while learner.servicer.version != VERSION + 1 and time.monotonic() < deadline:
        time.sleep(0.001)
    return thread


def test_a_fetch_streams_while_the_version_is_still_being_serialized(plain: Learnerish) -> None:
    last = threading.Event()

    def slow() -> Iterator[RawTensor]:
        yield from PUBLISHED[:-2]
        assert last.wait(10)  # the rest is serialized only after the reader got bytes
        yield from PUBLISHED[-2:]

    publishing = _publishing(plain, slow())
    granted = ticket(plain)
    assert granted.version == VERSION + 1
    frames = weight_socket.read_frames(
        weight_socket.connect("127.0.0.1", granted.port, granted.ticket, TlsConfig(), 10), 1 << 20
    )
    first = [bytes(next(frames))]  # streamed before the publication finished
    assert publishing.is_alive()
    last.set()
    version, tensors = assemble_update(Assembling.of_frames(first + [bytes(f) for f in frames]))
    publishing.join(10)
    assert version == VERSION + 1 and as_tuples(tensors) == as_tuples(PUBLISHED)


def test_a_publication_that_breaks_off_ends_its_streams_with_an_error(plain: Learnerish) -> None:
    go = threading.Event()

    def broken() -> Iterator[RawTensor]:
        yield PUBLISHED[0]
        assert go.wait(10)
        raise RuntimeError("gather failed")

    errors: list[BaseException] = []

    def publish() -> None:
        try:
            plain.servicer.publish(VERSION + 1, broken(), len(PUBLISHED))
        except RuntimeError as exc:
            errors.append(exc)

    thread = threading.Thread(target=publish, daemon=True)
    thread.start()
    while plain.servicer.version != VERSION + 1:
        time.sleep(0.001)
    granted = ticket(plain)
    go.set()
    with pytest.raises(WeightSocketError, match="closed after"):  # no end marker: not short
        redeem(granted)
    thread.join(10)
    assert [str(e) for e in errors] == ["gather failed"]


def test_a_ticket_serves_the_version_it_was_issued_for(plain: Learnerish) -> None:
    granted = ticket(plain)
    plain.servicer.publish(VERSION + 1, PUBLISHED)  # the next step lands in between
    sock = weight_socket.connect("127.0.0.1", granted.port, granted.ticket, TlsConfig(), 10)
    version, _ = assemble_update(Assembling.of_frames(read_all(sock)))
    assert version == VERSION


@pytest.mark.parametrize("bad", ["reused", "forged", "expired", "short"])
def test_bad_tickets_get_nothing_and_the_socket_keeps_serving(plain: Learnerish, bad: str) -> None:
    granted = ticket(plain)
    if bad == "reused":
        redeem(granted)
    elif bad == "expired":
        time.sleep(2.2)  # ticket_ttl_s = 2
    value = {"forged": bytes(32), "short": granted.ticket[:5]}.get(bad, granted.ticket)
    sock = weight_socket.connect("127.0.0.1", granted.port, value, TlsConfig(), 30)
    if bad == "short":
        sock.shutdown(socket.SHUT_WR)  # the server must not wait for the rest forever
    with pytest.raises(WeightSocketError, match="closed after 0 of 8 bytes"):
        read_all(sock)
    assert pull(plain)[0] == "weight socket"


def test_a_frame_over_the_limit_is_refused(plain: Learnerish) -> None:
    granted = ticket(plain)
    sock = weight_socket.connect("127.0.0.1", granted.port, granted.ticket, TlsConfig(), 10)
    with pytest.raises(WeightSocketError, match="exceeds the limit of 100"):
        read_all(sock, max_frame=100)


def test_without_a_socket_or_when_unreachable_the_grpc_stream_is_used(
    plain: Learnerish, caplog: pytest.LogCaptureFixture
) -> None:
    plain.servicer.weight_socket = None  # learner.publication.transport=grpc
    transport, tensors = pull(plain)
    assert transport == "FetchWeights stream" and tensors == as_tuples(PUBLISHED)
    plain.servicer.weight_socket = plain.socket
    plain.socket.stop()  # the ticket names a port nobody listens on any more
    with caplog.at_level(logging.WARNING):
        transport, tensors = pull(plain)
    assert transport == "FetchWeights stream" and tensors == as_tuples(PUBLISHED)
    assert "unreachable" in caplog.text


def test_open_weight_socket_needs_the_token() -> None:
    auth = AuthConfig(token="t0ken")
    learner = Learnerish(SecurityConfig(auth=auth))
    try:
        with channel(learner.address) as chan:
            with pytest.raises(grpc.RpcError) as err:
                WeightStub(chan).OpenWeightSocket(learner_pb2.FetchWeightsRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert pull(learner, SecurityConfig(auth=auth))[0] == "weight socket"
    finally:
        learner.close()


def tls(pki: Pki, mtls: bool, issued: Any = None, ca: Path | None = None) -> TlsConfig:
    files = {"cert": str(issued.cert), "key": str(issued.key)} if issued else {}
    return TlsConfig(enabled=True, ca=str(ca or pki.ca), mtls=mtls, **files)


@pytest.mark.parametrize("mtls", [False, True])
def test_tls_and_mtls_guard_the_socket(pki: Pki, mtls: bool) -> None:
    server_side = tls(pki, mtls, pki.server)
    learner = Learnerish(SecurityConfig(tls=server_side))
    try:
        client = tls(pki, mtls, pki.client if mtls else None)
        assert pull(learner, SecurityConfig(tls=client)) == ("weight socket", as_tuples(PUBLISHED))
        granted_for = SecurityConfig(tls=client)
        with channel(learner.address, granted_for) as chan:
            request = learner_pb2.FetchWeightsRequest()
            granted = WeightStub(chan).OpenWeightSocket(request, timeout=10)
        with pytest.raises((WeightSocketError, OSError)):  # plaintext to the TLS socket
            read_all(
                weight_socket.connect("127.0.0.1", granted.port, granted.ticket, TlsConfig(), 10)
            )
        untrusted = tls(pki, mtls, pki.client if mtls else None, ca=pki.other_ca)
        with pytest.raises(OSError, match="CERTIFICATE_VERIFY_FAILED"):
            weight_socket.connect("127.0.0.1", granted.port, granted.ticket, untrusted, 10)
        if mtls:  # a client cert from another CA, and none at all
            for bad in (tls(pki, True, pki.foreign_client), tls(pki, False)):
                with pytest.raises((WeightSocketError, OSError)):
                    read_all(
                        weight_socket.connect("127.0.0.1", granted.port, granted.ticket, bad, 10)
                    )
        # The ticket was never redeemed by any of them: the rightful client still gets it.
        assert len(redeem(granted, client)) >= 3
    finally:
        learner.close()


def test_a_frozen_reader_is_dropped_and_frees_its_slot() -> None:
    """A reader that takes no whole frame within frame_timeout_s (a SIGSTOPped rollout
    server, a partition) loses its connection: it must not hold one of the 16 slots for
    the whole transfer deadline."""
    server = WeightSocketServer("127.0.0.1", 0, TlsConfig(), frame_timeout_s=0.5).start()
    frames = [[bytes(8 << 20)]] * 8  # 64 MiB: more than the loopback socket buffers hold
    try:
        frozen = dial(server, frames)
        assert wait_for(lambda: connection_threads() == 1)  # serving it
        assert wait_for(lambda: connection_threads() == 0)  # gave up on the frozen reader
        with pytest.raises(WeightSocketError):  # which finds its stream cut short
            read_all(frozen, max_frame=8 << 20)
        assert len(read_all(dial(server, frames[:1]), max_frame=8 << 20)) == 1  # slot free
    finally:
        server.stop()


def dial(server: WeightSocketServer, frames: list[weight_socket.Frame]) -> socket.socket:
    """A plaintext client that has sent a fresh ticket for `frames`."""
    return weight_socket.connect("127.0.0.1", server.port, server.issue(frames), TlsConfig(), 30)


def wait_for(condition: Any, timeout: float = 20) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def connection_threads() -> int:
    return sum(t.name == weight_socket.CONNECTION_THREAD for t in threading.enumerate())


def test_outstanding_tickets_are_bounded(
    plain: Learnerish, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A flood of OpenWeightSocket calls that never redeem gets RESOURCE_EXHAUSTED once
    MAX_TICKETS are out; redeeming one makes room again."""
    monkeypatch.setattr(weight_socket, "MAX_TICKETS", 3)
    granted = [ticket(plain) for _ in range(3)]
    with pytest.raises(grpc.RpcError) as err:
        ticket(plain)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "outstanding" in err.value.details()
    assert len(redeem(granted[0])) >= 3
    assert ticket(plain).port == plain.socket.port


class CountingSocket(socket.socket):
    """A real socket that counts the sendmsg calls the kernel took only in part."""

    partial = 0

    def sendmsg(self, buffers: Any, *args: Any) -> int:
        buffers = list(buffers)
        sent = super().sendmsg(buffers, *args)
        self.partial += sent < sum(len(b) for b in buffers)
        return sent


def test_a_frame_goes_out_scatter_gather_whole_through_partial_sends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`send_frame` on a real loopback socket: 8 MiB of large parts with tiny ones between
    (the metadata around each slice) arrive as exactly the length and the joined parts,
    though the kernel takes sendmsg calls only in part (a small send buffer, a timeout as
    the server sets) and a call carries at most IOV_MAX buffers (3 here)."""
    monkeypatch.setattr(weight_socket, "IOV_MAX", 3)
    parts: weight_socket.Frame = []
    for i in range(32):
        parts += [bytes([i, 1]), b"\x22", memoryview(bytes([i]) * (256 << 10))]
    listener = socket.create_server(("127.0.0.1", 0))
    with socket.create_connection(listener.getsockname(), timeout=10) as client:
        accepted, _ = listener.accept()
        server = CountingSocket(fileno=accepted.detach())
        server.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
        server.settimeout(10)
        sender = threading.Thread(target=weight_socket.send_frame, args=(server, parts))
        sender.start()
        got = bytearray()
        while len(got) < 8 + (8 << 20) + 32 * 3:
            got += client.recv(1 << 16)
        sender.join(10)
        server.close()
    listener.close()
    assert got == weight_socket.FRAME.pack(len(got) - 8) + b"".join(parts)
    assert server.partial > 0


def test_small_parts_are_joined_and_large_ones_passed_as_they_are() -> None:
    big, other = memoryview(bytes(weight_socket.COALESCE_BYTES)), bytes(1 << 20)
    out = weight_socket.coalesce([b"ab", b"c", big, b"d", b"e", other])
    assert out == [b"abc", big, b"de", other]
    assert out[1] is big and out[3] is other  # no copy of the tensor bytes
