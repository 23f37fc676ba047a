"""The relay chain (services/weight_transport/relay.py): real rollout servers (torch
engine, tiny model),
real Redis registry, a real learner WeightService with its weight socket. The learner
serves one stream per version whatever the number of servers, every server ends with the
learner's exact weights, a stalled or dead server in the chain costs at most the relay
timeout (then the learner's path), and a late joiner catches up.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import redis
import torch
from rollout_fixtures import make_config, perturbed, serve, wait_for

from learner.weights import WeightServicer, add_weight_service
from services.common.grpc_server import start_grpc_server
from services.common.keys import RunKeys
from services.common.registry import Registration, discover
from services.common.security import TlsConfig
from services.common.server_config import ServerConfig
from services.weight_transport.assembly import WeightAssembler
from services.weight_transport.relay import RelayHub, relay_parent
from services.weight_transport.tensor_codec import (
    encode_bucket_bytes,
    parse_bucket,
    wire_bucket_parts,
)
from services.weight_transport.torch_codec import from_torch
from services.weight_transport.weight_socket import WeightSocketServer


class CountingServicer(WeightServicer):
    """The learner's WeightService, counting the weight streams it serves."""

    streams = 0

    def OpenWeightSocket(self, request, context):  # noqa: N802 (gRPC's name)
        self.streams += 1
        return super().OpenWeightSocket(request, context)

    def fetch_serialized(self, request, context):
        self.streams += 1
        return super().fetch_serialized(request, context)


@contextlib.contextmanager
def learner(client: redis.Redis, keys: RunKeys) -> Iterator[CountingServicer]:
    servicer = CountingServicer(4096, WeightSocketServer("127.0.0.1", 0, TlsConfig()).start())
    server, port = start_grpc_server(
        ServerConfig(), lambda s: add_weight_service(servicer, s), ["dapo.v1.WeightService"]
    )
    info = {"address": f"127.0.0.1:{port}"}
    registration = Registration(client, keys, "learner", "learner-0", info).start()
    try:
        yield servicer
    finally:
        registration.stop()
        server.stop(grace=0)
        servicer.close()


def publish(
    client: redis.Redis, keys: RunKeys, servicer: WeightServicer, version: int, engine: object
) -> dict[str, torch.Tensor]:
    """A new policy published as the learner does (weights, then the version in Redis)."""
    tensors = perturbed(engine, seed=version)  # type: ignore[arg-type]
    servicer.publish(version, tensors)
    client.set(keys.version, version)
    return {t.name: torch.frombuffer(bytearray(t.data), dtype=torch.float32) for t in tensors}


def assert_exact(served, expected: dict[str, torch.Tensor]) -> None:
    loaded = dict(served.engine.model.named_parameters())
    for name, flat in expected.items():
        assert torch.equal(loaded[name].detach().reshape(-1), flat), name


def test_chain_order_comes_from_the_registry() -> None:
    entries = [{"instance": n, "relay": 1, "address": "h:1"} for n in ("r-a", "r-b", "r-c")]
    entries.insert(1, {"instance": "r-ab", "address": "h:1"})  # no relay: not in the chain
    assert relay_parent(entries, "r-a") is None
    assert relay_parent(entries, "r-b")["instance"] == "r-a"  # type: ignore[index]
    assert relay_parent(entries, "r-c")["instance"] == "r-b"  # type: ignore[index]
    assert relay_parent(entries, "r-unknown") is None


def test_learner_sends_each_version_once_to_a_chain_of_three(
    tiny_model: Path, redis_client: redis.Redis
) -> None:
    keys = RunKeys(f"relay-{uuid.uuid4().hex[:6]}")
    config = make_config(keys.run, relay_timeout_s=5.0)
    with (
        learner(redis_client, keys) as servicer,
        serve(tiny_model, config, redis_client) as a,
        serve(tiny_model, config, redis_client) as b,
        serve(tiny_model, config, redis_client) as c,
    ):
        assert len([e for e in discover(redis_client, keys, "rollout") if e["relay"]]) == 3
        for version in (1, 2, 3):
            expected = publish(redis_client, keys, servicer, version, a.engine)
            wait_for(lambda v=version: all(s.engine.version == v for s in (a, b, c)))
            for served in (a, b, c):
                assert_exact(served, expected)
            assert servicer.streams == version  # one stream per version, not three


class StalledRelay:
    """A relay that reads the request, announces a frame and then sends nothing."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.listener.accept()
                conn.recv(40)
                conn.sendall((1 << 20).to_bytes(8, "little"))
                self.held.append(conn)

    def close(self) -> None:
        self.listener.close()
        for conn in self.held:
            conn.close()


def _head_of_chain(client: redis.Redis, keys: RunKeys, relay_port: int) -> None:
    """A registry entry that sorts before every real server (hex uuids) at the chain's head."""
    info = {"instance": "rollout-0", "address": "127.0.0.1:1", "relay": relay_port}
    client.set(f"{keys.registry('rollout')}:rollout-0", json.dumps(info), px=60_000)


def test_a_stalled_or_dead_parent_costs_one_timeout_then_the_learner_path(
    tiny_model: Path, redis_client: redis.Redis
) -> None:
    keys = RunKeys(f"relay-{uuid.uuid4().hex[:6]}")
    config = make_config(keys.run, relay_timeout_s=1.0)
    stalled = StalledRelay()
    dead = socket.create_server(("127.0.0.1", 0))
    dead_port = dead.getsockname()[1]
    dead.close()  # nothing listens there any more: connection refused
    try:
        with (
            learner(redis_client, keys) as servicer,
            serve(tiny_model, config, redis_client) as a,
            serve(tiny_model, config, redis_client) as b,
        ):
            for version, port in ((1, stalled.port), (2, dead_port)):
                _head_of_chain(redis_client, keys, port)
                expected = publish(redis_client, keys, servicer, version, a.engine)
                wait_for(lambda v=version: a.engine.version == v and b.engine.version == v)
                assert_exact(a, expected)
                assert_exact(b, expected)
                # the first real server fell back to the learner; the second relayed from it
                assert servicer.streams == version
    finally:
        stalled.close()


def test_a_late_joiner_catches_up(tiny_model: Path, redis_client: redis.Redis) -> None:
    keys = RunKeys(f"relay-{uuid.uuid4().hex[:6]}")
    config = make_config(keys.run, relay_timeout_s=2.0)
    with (
        learner(redis_client, keys) as servicer,
        serve(tiny_model, config, redis_client) as a,
    ):
        expected = publish(redis_client, keys, servicer, 1, a.engine)
        wait_for(lambda: a.engine.version == 1)
        with serve(tiny_model, config, redis_client) as late:
            wait_for(lambda: late.engine.version == 1)
            assert_exact(late, expected)
            expected = publish(redis_client, keys, servicer, 2, a.engine)
            wait_for(lambda: a.engine.version == 2 and late.engine.version == 2)
            assert_exact(late, expected)


def _model_frames(version: int = 7) -> list[bytes]:
    gen = torch.Generator().manual_seed(0)
    tensors = [from_torch(f"w{i}", torch.randn(300 + i, generator=gen)) for i in range(5)]
    return list(encode_bucket_bytes(tensors, version, 1024))


def test_relayed_frames_are_the_learners_bytes() -> None:
    frames = _model_frames()
    relayed: list[bytes] = []
    assembler = WeightAssembler(
        on_bucket=lambda b, views: relayed.append(b"".join(wire_bucket_parts(b, views)))
    )
    for frame in frames:
        assembler.add(parse_bucket(frame))
    assert relayed == frames and len(frames) > 3


def test_a_bucket_is_forwarded_before_the_next_one_arrives() -> None:
    """Streaming, not store-and-forward: the child gets bucket 0 while bucket 1 is held."""
    frames, release = _model_frames(), threading.Event()

    def learner_stream() -> Iterator[bytes]:
        yield frames[0]
        assert release.wait(10)
        yield from frames[1:]

    hub = RelayHub(1 << 20, timeout_s=5.0)
    buckets = iter(hub.receive_frames(learner_stream()))
    first, _ = next(buckets)
    reception = hub.acquire(min_version=7, timeout=5.0)
    assert reception is not None and first.index == 0
    child = reception.iter_parts()
    assert b"".join(next(child)) == frames[0] and not release.is_set()
    release.set()
    assert [b.index for b, _ in buckets] == list(range(1, len(frames)))
    assert [b"".join(p) for p in child] == frames[1:]
    assert hub.acquire(min_version=8, timeout=0.1) is None  # nothing newer: the learner
