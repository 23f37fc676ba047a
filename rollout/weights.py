"""New weights for a rollout server, pulled from the learner.

`WeightUpdater.apply` loads an update only once every byte has arrived and been checked,
and only if its version is newer than the one served; the engine checks names, dtypes and
shapes first, so a bad bucket leaves the previous weights in place. `WeightSync` pulls
whenever the learner's published version moves ahead, from the first `WeightSource` that
offers it (`pull`: relay, weight socket, FetchWeights). How: docs/weight_publication.md.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import grpc
import redis

from dapo.v1 import learner_pb2, learner_pb2_grpc
from rollout.config import RolloutSettings
from rollout.engine import RolloutEngine
from rollout.metrics import RolloutMetrics
from services.common.grpc_server import channel
from services.common.keys import RunKeys
from services.common.registry import discover
from services.weight_transport import weight_socket
from services.weight_transport.assembly import (
    AssembledBuckets,
    Assembling,
    assemble_update,
)
from services.weight_transport.frame_reader import PlacedBuckets
from services.weight_transport.relay import (
    RelayedBuckets,
    RelayHub,
    chain_index,
    connect,
    first_frame_timeout,
    relay_parent,
)
from services.weight_transport.tensor_codec import (
    RawTensor,
    TensorWireError,
    WireBucket,
    parse_bucket,
)
from services.weight_transport.torch_codec import to_torch
from services.weight_transport.weight_socket import WeightSocketError

log = logging.getLogger(__name__)


class StaleUpdate(ValueError):
    """An update whose version is not newer than the one served."""


class WeightUpdater:
    """Applies whole updates to one engine, one load at a time."""

    def __init__(self, engine: RolloutEngine, metrics: RolloutMetrics) -> None:
        self.engine, self.metrics = engine, metrics
        self._lock = threading.Lock()
        self._loaded = threading.Condition()

    def wait_for(self, version: int, timeout: float) -> bool:
        """Block until the served version is at least `version` (False after `timeout`)."""
        with self._loaded:
            return self._loaded.wait_for(lambda: self.engine.version >= version, timeout)

    def apply(self, buckets: AssembledBuckets) -> int:
        """Assemble, check and load one update; raise (old weights stay) on anything wrong.
        `buckets`: a weight source's (raw WeightBuckets come wrapped in `Assembling`)."""
        started = time.perf_counter()
        try:
            version = self._apply(buckets)
        except Exception:
            self.metrics.weight_failures.inc()
            raise
        self.metrics.weight_seconds.observe(time.perf_counter() - started)
        return version

    def _apply(self, buckets: AssembledBuckets) -> int:
        try:
            for bucket, completed in buckets:
                self._check_newer(bucket.version)  # refuse early, before gigabytes arrive
                for raw in completed:  # checked while the next bucket arrives
                    check_finite(raw)
            assembler = buckets.assembler
            named = [(t.name, to_torch(t)) for t in assembler.result()]
        except BaseException as exc:
            buckets.abandon(exc)  # its socket closes, its relay children stop
            raise
        version = assembler.version or 0
        with self._lock:
            self._check_newer(version)
            self.engine.load_weights(named, version, owned=True)  # fresh buffers, ours alone
        with self._loaded:
            self._loaded.notify_all()
        return version

    def _check_newer(self, version: int) -> None:
        if version <= self.engine.version:
            raise StaleUpdate(f"version {version} is not newer than served {self.engine.version}")


# dtype → (signed and unsigned integer views of its bits, the exponent's bits all set)
_FLOAT_BITS = {
    "bfloat16": ("int16", "uint16", 0x7F80),
    "float16": ("int16", "uint16", 0x7C00),
    "float32": ("int32", "uint32", 0x7F800000),
    "float64": ("int64", "uint64", 0x7FF0000000000000),
}
FINITE_CHUNK = 1 << 18  # bytes per step: both reductions read it from cache


def check_finite(raw: RawTensor) -> None:
    """Refuse NaN or infinite values: one would poison every later sample's log-probs.

    A float is NaN or infinite exactly when its exponent bits are all set, i.e. its bits
    without the sign are at least `exponent`. On the bits viewed as integers: a positive
    one has signed value >= exponent, a negative one unsigned value >= sign | exponent
    (negative finite ones stay below). Two max reductions per cache-sized chunk: exact (no
    false alarm from a sum that overflows), and numpy's single-threaded reductions leave
    the second core to the socket copy (torch's spinning OpenMP threads took it: the
    sum-based check went from 0.08 s alone to 1.1 s per 1.26 GB during a fetch)."""
    import numpy

    if raw.dtype not in _FLOAT_BITS or not len(raw.data):
        return
    signed, unsigned, exponent = _FLOAT_BITS[raw.dtype]
    bits = numpy.frombuffer(raw.data, dtype=unsigned)
    # the sign bit set too; as a numpy scalar: against a Python int, uint64 compares as float
    negative = numpy.array(exponent | 1 << (8 * bits.itemsize - 1), dtype=unsigned)
    step = FINITE_CHUNK // bits.itemsize
    for start in range(0, bits.size, step):
        chunk = bits[start : start + step]
        if chunk.view(signed).max() >= exponent or chunk.max() >= negative:
            raise ValueError(
                f"weight {raw.name!r} holds NaN or infinite values; weights left unchanged"
            )


class WeightStub(learner_pb2_grpc.WeightServiceStub):
    """The generated stub, except that FetchWeights yields `parse_bucket` WireBuckets: the
    tensor bytes are viewed in the received message, never copied by protobuf, and copied
    once into the update's buffers by WeightAssembler."""

    def __init__(self, channel: grpc.Channel) -> None:
        super().__init__(channel)
        raw = channel.unary_stream(
            "/dapo.v1.WeightService/FetchWeights",
            request_serializer=learner_pb2.FetchWeightsRequest.SerializeToString,
            response_deserializer=None,  # the serialized bytes
        )
        self.fetch_raw = raw  # the serialized buckets, for a relay to keep

        def fetch_weights(
            request: learner_pb2.FetchWeightsRequest, **kwargs: Any
        ) -> Iterator[WireBucket]:
            return map(parse_bucket, raw(request, **kwargs))

        self.FetchWeights = fetch_weights


class WeightSource(Protocol):
    """One way the learner's latest weights reach this server (its weight socket, its
    FetchWeights stream, the previous server's relay). `pull` tries the sources in order
    and loads from the first that offers an update."""

    name: str  # for logs: "loaded weights ... over the <name>"
    # whether its transfer may break off for reasons of its own (a relay parent that died
    # or stalled): then `pull` goes on to the next source; other sources' errors are final
    fallible: bool

    def fetch(self) -> AssembledBuckets | None:
        """The latest version's buckets, or None when this source is not on offer."""
        ...


@dataclass
class WeightSocketSource:
    """A ticket over gRPC, the bytes over the learner's weight socket (the fast path)."""

    stub: WeightStub
    address: str
    config: RolloutSettings
    hub: RelayHub | None = None  # relay what arrives to the next server in the chain
    name: str = "weight socket"
    fallible: bool = False

    def fetch(self) -> AssembledBuckets | None:
        return socket_buckets(self.stub, self.address, self.config, self.hub)


@dataclass
class FetchWeightsSource:
    """The learner's FetchWeights gRPC stream: always offered, slower than the socket."""

    stub: WeightStub
    config: RolloutSettings
    hub: RelayHub | None = None
    name: str = "FetchWeights stream"
    fallible: bool = False

    def fetch(self) -> AssembledBuckets:
        request = learner_pb2.FetchWeightsRequest(version=0)
        timeout = self.config.shared.rpc.weights_timeout_s
        if self.hub is not None:
            return self.hub.receive_frames(self.stub.fetch_raw(request, timeout=timeout))
        return Assembling(self.stub.FetchWeights(request, timeout=timeout))


@dataclass
class RelaySource:
    """The previous rollout server's relay: a weight source that may break off (then the
    learner's sources are tried next, see `rollout.weights.pull`)."""

    parent: dict[str, Any]  # its registry entry (address, relay port)
    index: int  # ours in the chain
    min_version: int
    hub: RelayHub
    config: RolloutSettings
    name: str = "relay"
    fallible: bool = True  # a parent may die or stall: then the learner's sources follow

    def fetch(self) -> RelayedBuckets | None:
        host = self.parent["address"].rsplit(":", 1)[0].strip("[]")
        security = self.config.security
        try:
            sock = connect(
                host,
                int(self.parent["relay"]),
                self.min_version,
                security.tls,
                security.auth.secret(),
                self.config.rollout.relay_timeout_s,
            )
        except OSError as exc:
            log.warning("relay %s unreachable (%s); pulling from the learner", host, exc)
            return None
        timeout = self.config.rollout.relay_timeout_s
        return self.hub.receive(sock, first_frame_timeout(self.index, timeout))


def learner_sources(
    stub: WeightStub, address: str, config: RolloutSettings, hub: RelayHub | None = None
) -> list[WeightSource]:
    """The learner's transports, fastest first."""
    return [WeightSocketSource(stub, address, config, hub), FetchWeightsSource(stub, config, hub)]


def fetch_update(
    stub: WeightStub, address: str, config: RolloutSettings
) -> tuple[str, tuple[int, list[RawTensor]]]:
    """(transport, (version, tensors)) of the learner's latest weights: over its weight
    socket when it offers one, else (or when the socket cannot be reached) over the
    FetchWeights stream."""
    return pull(learner_sources(stub, address, config), WholeUpdate())


def socket_buckets(
    stub: WeightStub, address: str, config: RolloutSettings, hub: RelayHub | None = None
) -> AssembledBuckets | None:
    """The latest version's buckets over the weight socket; None when the learner offers
    none (learner.publication.transport=grpc) or it cannot be reached (a warning says why).
    With a `hub` the frames are kept and relayed to the next server as they arrive."""
    rpc, request = config.shared.rpc, learner_pb2.FetchWeightsRequest(version=0)
    try:
        ticket = stub.OpenWeightSocket(request, timeout=rpc.control_timeout_s)
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
            raise
        return None
    host = address.rsplit(":", 1)[0].strip("[]")
    try:
        sock = weight_socket.connect(
            host, ticket.port, ticket.ticket, config.security.tls, rpc.weights_timeout_s
        )
    except OSError as exc:  # ssl.SSLError included
        log.warning(
            "weight socket %s:%d unreachable (%s); using the FetchWeights stream",
            host,
            ticket.port,
            exc,
        )
        return None
    if hub is not None:
        return hub.receive(sock)
    return PlacedBuckets(sock, config.shared.rpc.max_message_bytes)  # in place, no copy


Received = TypeVar("Received", covariant=True)


class Receiver(Protocol[Received]):
    """What takes an offered update: `WeightUpdater` loads it, `WholeUpdate` returns it."""

    def apply(self, buckets: AssembledBuckets) -> Received: ...


class WholeUpdate:
    """A receiver that returns the update as it is: (version, tensors)."""

    def apply(self, buckets: AssembledBuckets) -> tuple[int, list[RawTensor]]:
        return assemble_update(buckets)


def pull(sources: Iterable[WeightSource], receiver: Receiver[Received]) -> tuple[str, Received]:
    """(source name, what `receiver` made of its buckets) from the first source that offers
    an update. A later source is asked only if the earlier ones offered nothing, or a
    fallible one (a relay whose server died, stalled or moved on) broke off."""
    for source in sources:
        buckets = source.fetch()
        if buckets is None:
            continue
        try:
            return source.name, receiver.apply(buckets)
        except (WeightSocketError, TensorWireError) as exc:
            if not source.fallible:
                raise
            log.warning("%s failed (%s); trying the next source", source.name, exc)
    raise LookupError("no weight source offered an update")


SourcesFor = Callable[[WeightStub, str], list[WeightSource]]
"""The weight sources to try for one learner (its stub and address), in order."""


class WeightSync:
    """Pulls new weights from the learner whenever the published version moves ahead."""

    def __init__(
        self,
        config: RolloutSettings,
        client: redis.Redis,
        updater: WeightUpdater,
        sources: SourcesFor | None = None,
        hub: RelayHub | None = None,
    ) -> None:
        self.config, self.client, self.updater, self.hub = config, client, updater, hub
        self.sources = sources or (
            lambda stub, address: learner_sources(stub, address, config, hub)
        )
        self.instance: str | None = None  # our registry name: where we sit in the chain
        self.keys = RunKeys(config.shared.run_name)
        self.caught_up = threading.Event()
        self._wake = threading.Event()
        self._channel: tuple[str, grpc.Channel] | None = None

    def wake(self) -> None:
        """Look for a new version now instead of at the next poll (a request needs it)."""
        self._wake.set()

    def _stub(self, address: str) -> WeightStub:
        """A stub on one channel per learner address, kept across syncs."""
        if self._channel is None or self._channel[0] != address:
            if self._channel is not None:
                self._channel[1].close()
            max_bytes = self.config.shared.rpc.max_message_bytes
            self._channel = (address, channel(address, self.config.security, max_bytes))
        return WeightStub(self._channel[1])

    @property
    def served(self) -> int:
        return self.updater.engine.version

    def published(self) -> int:
        """The learner's latest committed version (0 before its first step)."""
        return int(self.client.get(self.keys.version) or 0)

    def ready(self) -> bool:
        """Caught up with the learner once, so it can serve. Being behind a newer version
        is the staleness gate's business (min_version, the buffer's max_staleness), not
        readiness': every publication would otherwise make every server unready for the
        length of its update, and drop it from DNS and the Service (docs/deploy.md)."""
        return self.caught_up.is_set()

    def sync_once(self) -> bool:
        """Fetch and load the latest version if newer; True if weights changed."""
        target = self.published()
        if target <= self.served:
            self.caught_up.set()
            return False
        learners = discover(self.client, self.keys, "learner")
        if not learners:
            log.info("version %d published but no learner registered yet", target)
            return False
        address = learners[0]["address"]
        stub, rpc = self._stub(address), self.config.shared.rpc
        request = learner_pb2.GetVersionRequest()
        offered = stub.GetVersion(request, timeout=rpc.control_timeout_s).version
        if offered <= self.served:
            return False  # the learner's snapshot is not there yet
        sources = self._relay_sources() + self.sources(stub, address)
        transport, version = pull(sources, self.updater)
        log.info("loaded weights version=%d (published %d) over the %s", version, target, transport)
        if version >= target:
            self.caught_up.set()
        return True

    def _relay_sources(self) -> list[WeightSource]:
        """The previous server in the chain, when we relay and are not its head."""
        if self.hub is None or self.instance is None:
            return []
        entries = discover(self.client, self.keys, "rollout")
        parent, index = relay_parent(entries, self.instance), chain_index(entries, self.instance)
        if parent is None or index is None:
            return []
        return [RelaySource(parent, index, self.served + 1, self.hub, self.config)]

    def run(self, stop: threading.Event, after_each: Callable[[], None]) -> None:
        """Sync now, then every `weight_poll_s`; call `after_each` after every attempt."""
        while not stop.is_set():
            try:
                self.sync_once()
            except StaleUpdate as exc:
                log.debug("weight sync raced another update: %s", exc)
            except (
                grpc.RpcError,
                TensorWireError,
                WeightSocketError,
                ValueError,
                LookupError,
                redis.RedisError,
            ) as exc:
                log.warning("weight sync failed, will retry: %s", exc)
            except Exception:  # the loop must outlive any surprise, or readiness freezes
                log.exception("weight sync failed unexpectedly, will retry")
            after_each()
            self._wake.wait(self.config.rollout.weight_poll_s)
            self._wake.clear()
