"""The learner serves each version from a pooled snapshot (learner/snapshots.py), zero-copy:
a snapshot is reused only once nothing can read its version any more.

Real components throughout: a `WeightServicer` with its weight socket on a real gRPC
server; readers are the weight socket client (`rollout.weights`'s, or raw frames) and the
generated FetchWeights stub. The live weights are numpy arrays, rewritten in place after
each publish as a training step would.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy
import pytest

from dapo.v1 import learner_pb2, learner_pb2_grpc
from learner.publisher import BackgroundPublisher
from learner.weights import WeightServicer, add_weight_service
from rollout.weights import WeightStub, fetch_update
from services.common.grpc_server import insecure_channel, start_grpc_server
from services.common.security import TlsConfig
from services.common.server_config import ServerConfig
from services.tools.config import DapoConfig
from services.weight_transport import weight_socket
from services.weight_transport.assembly import Assembling, assemble_update
from services.weight_transport.tensor_codec import RawTensor
from services.weight_transport.weight_socket import WeightSocketServer

TENSORS, TENSOR_BYTES = 6, 8 << 20  # 48 MiB: far more than loopback socket buffers hold
BUCKET = 1 << 20


class Learner:
    """Live weights + the learner's WeightService and weight socket."""

    def __init__(self, ticket_ttl_s: float = 60.0) -> None:
        self.live = [numpy.empty(TENSOR_BYTES, dtype=numpy.uint8) for _ in range(TENSORS)]
        self.socket = WeightSocketServer("127.0.0.1", 0, TlsConfig(), ticket_ttl_s).start()
        self.servicer = WeightServicer(BUCKET, self.socket)
        self.server, port = start_grpc_server(
            ServerConfig(),
            lambda s: add_weight_service(self.servicer, s),
            ["dapo.v1.WeightService"],
        )
        self.address = f"127.0.0.1:{port}"
        self.channel = insecure_channel(self.address, 64 << 20)

    def train(self, version: int) -> list[bytes]:
        """Rewrite the live weights in place with `version`'s values; their digests."""
        rng = numpy.random.default_rng(version)
        for array in self.live:
            array[:] = rng.integers(0, 256, TENSOR_BYTES, dtype=numpy.uint8)
        return [hashlib.sha256(array).digest() for array in self.live]

    def views(self) -> list[RawTensor]:
        shape = (TENSOR_BYTES,)
        return [RawTensor(f"w{i}", "uint8", shape, memoryview(a)) for i, a in enumerate(self.live)]

    def ticket(self) -> learner_pb2.WeightSocketTicket:
        stub = WeightStub(self.channel)
        return stub.OpenWeightSocket(learner_pb2.FetchWeightsRequest(), timeout=10)

    def close(self) -> None:
        self.channel.close()
        self.server.stop(0)
        self.socket.stop()


@pytest.fixture
def learner() -> Iterator[Learner]:
    made = Learner()
    yield made
    made.close()


def open_stream(granted: learner_pb2.WeightSocketTicket) -> Iterator[memoryview]:
    sock = weight_socket.connect("127.0.0.1", granted.port, granted.ticket, TlsConfig(), 30)
    return weight_socket.read_frames(sock, 64 << 20)


def contents(version_and_tensors: tuple[int, list[RawTensor]]) -> tuple[int, list[bytes]]:
    """(version, each tensor's SHA-256): bitwise equal, compared in a readable size."""
    version, tensors = version_and_tensors
    return version, [hashlib.sha256(t.data).digest() for t in tensors]


def pull(learner: Learner) -> tuple[str, tuple[int, list[bytes]]]:
    """A rollout server's fetch (the weight socket), assembled."""
    transport, update = fetch_update(WeightStub(learner.channel), learner.address, DapoConfig())
    return transport, contents(update)


def grpc_pull(learner: Learner) -> tuple[int, list[bytes]]:
    stub = learner_pb2_grpc.WeightServiceStub(learner.channel)
    return contents(
        assemble_update(Assembling(stub.FetchWeights(learner_pb2.FetchWeightsRequest())))
    )


def readers_gone() -> bool:
    """Every weight socket connection thread has ended (its reader finished)."""
    deadline = time.monotonic() + 20
    while any(t.name == weight_socket.CONNECTION_THREAD for t in threading.enumerate()):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_stream_in_progress_keeps_its_version_while_newer_ones_are_published(
    learner: Learner,
) -> None:
    """A weight socket stream and a FetchWeights stream of version 1 read one frame each,
    then versions 2, 3, 4 are published (the weights trained in place between): the rest
    of both streams is still bitwise version 1. The pool grew to 3 snapshots (1 pinned by
    its readers, 2 free once 3 superseded it, 3) instead of overwriting version 1's."""
    expected = learner.train(1)
    learner.servicer.publish(1, learner.views())
    frames = open_stream(learner.ticket())
    first = [bytes(next(frames))]  # the reader is mid-stream from here on
    stub = learner_pb2_grpc.WeightServiceStub(learner.channel)
    messages = stub.FetchWeights(learner_pb2.FetchWeightsRequest(), timeout=60)
    grpc_first = [next(messages)]
    for version in (2, 3, 4):
        learner.train(version)
        learner.servicer.publish(version, learner.views())
    rest = [bytes(frame) for frame in frames]
    assert contents(assemble_update(Assembling.of_frames(first + rest))) == (1, expected)
    assert contents(assemble_update(Assembling(grpc_first + list(messages)))) == (1, expected)
    assert learner.servicer.pool.allocated == 3
    assert readers_gone()
    newest = learner.train(5)  # the readers are done: version 1's snapshot is free again
    learner.servicer.publish(5, learner.views())
    assert pull(learner) == ("weight socket", (5, newest))
    assert learner.servicer.pool.allocated == 3


def test_in_the_steady_state_the_pool_holds_two_snapshots(learner: Learner) -> None:
    """Six versions, each fetched over the weight socket and the FetchWeights stream
    before the next: every fetch is bitwise its version, and the pool never grows past
    two snapshots (the version served and the next one being taken)."""
    for version in range(1, 7):
        expected = learner.train(version)
        learner.servicer.publish(version, learner.views())
        assert pull(learner) == ("weight socket", (version, expected))
        assert grpc_pull(learner) == (version, expected)
        assert readers_gone()
    assert learner.servicer.pool.allocated == 2


def test_an_expired_ticket_does_not_pin_its_snapshot() -> None:
    """A ticket never redeemed holds its version until it expires; publishing purges it,
    so the pool does not grow for it."""
    learner = Learner(ticket_ttl_s=0.3)
    try:
        learner.train(1)
        learner.servicer.publish(1, learner.views())
        learner.ticket()  # never redeemed
        time.sleep(0.4)
        for version in (2, 3, 4):
            learner.train(version)
            learner.servicer.publish(version, learner.views())
        assert learner.servicer.pool.allocated == 2
    finally:
        learner.close()


def snapshot_buffers(servicer: WeightServicer) -> set[int]:
    """ids of the arrays the current version's frames view (its snapshot's buffers)."""
    assert servicer._encoded is not None
    viewed = {id(p.obj) for frame in servicer._encoded for p in frame if isinstance(p, memoryview)}
    return viewed


def test_background_publication_serves_the_step_snapshot_without_copying_it(
    learner: Learner,
) -> None:
    """The publisher's snapshot is what the servicer serves (its frames view the
    snapshot's buffers, not the live weights and not a copy), the two snapshots alternate
    from version to version, and every version fetched is bitwise what was trained."""
    publisher = BackgroundPublisher(learner.servicer)
    viewed: list[set[int]] = []
    live = {id(array) for array in learner.live}
    for version in range(1, 7):
        expected = learner.train(version)
        publisher.submit(version, learner.views())
        learner.train(100 + version)  # the next step trains in place right away
        publisher.wait()
        assert pull(learner) == ("weight socket", (version, expected))
        assert readers_gone()
        viewed.append(snapshot_buffers(learner.servicer))
    assert len(viewed[0]) == TENSORS and not viewed[0] & live
    assert viewed[0] != viewed[1] and viewed[0::2] == [viewed[0]] * 3
    assert viewed[1::2] == [viewed[1]] * 3
    assert learner.servicer.pool.allocated == 2


def test_a_re_cut_is_bitwise_the_version(learner: Learner) -> None:
    """A request for smaller buckets streams a re-cut (frames of its own copy)."""
    expected = learner.train(1)
    learner.servicer.publish(1, learner.views())
    stub = learner_pb2_grpc.WeightServiceStub(learner.channel)
    request = learner_pb2.FetchWeightsRequest(bucket_bytes=BUCKET // 4)
    messages: list[Any] = list(stub.FetchWeights(request, timeout=60))
    assert len(messages) >= TENSORS * TENSOR_BYTES // (BUCKET // 4)
    assert contents(assemble_update(Assembling(messages))) == (1, expected)
