"""The learner's WeightService: rollout servers pull the latest weights from here.

`publish` copies a version once into a pooled host snapshot and cuts it into frames that
view it (`encode_bucket_parts`), offered as soon as publication starts (a `FrameLog`);
`publish_snapshot` serves a snapshot already taken, with no copy. Fetches go over the
weight socket (`OpenWeightSocket` tickets) or the FetchWeights stream, both sending those
frames. The path and its copies: docs/weight_publication.md, "The path".
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import grpc
import torch

from dapo.v1 import learner_pb2, learner_pb2_grpc
from learner.snapshots import Snapshot, SnapshotPool
from services.common.grpc_server import abort
from services.weight_transport.assembly import WeightAssembler
from services.weight_transport.frame_log import FrameLog
from services.weight_transport.tensor_codec import RawTensor, encode_bucket_parts, parse_bucket
from services.weight_transport.torch_codec import torch_view
from services.weight_transport.weight_socket import Frame, TooManyTickets, WeightSocketServer


def live_views(named: Iterable[tuple[str, torch.Tensor]]) -> list[RawTensor]:
    """The weights as RawTensors viewing their CPU memory (no copy): `publish` them
    before the weights change."""
    return list(stream_views(named))


def stream_views(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[RawTensor]:
    """`live_views` one at a time: with `publish(..., total=)` a tensor (a gathered
    ZeRO-3 weight) is let go once copied into the snapshot."""
    return (torch_view(name, tensor) for name, tensor in named)


MIN_BUCKET_BYTES = 1024  # smaller: one message per few bytes (found by fuzzing)


class WeightServicer(learner_pb2_grpc.WeightServiceServicer):
    """Serves the latest published version from its pooled snapshot."""

    def __init__(self, bucket_bytes: int, weight_socket: WeightSocketServer | None = None) -> None:
        self.bucket_bytes = bucket_bytes
        self.weight_socket = weight_socket
        self.pool = SnapshotPool()
        self._lock = threading.Lock()
        self._version = 0
        self._encoded: FrameLog | None = None  # the latest version, in buckets of bucket_bytes

    def publish(self, version: int, tensors: Iterable[RawTensor], total: int | None = None) -> None:
        """Copy `tensors` into a pooled snapshot (they may view live weights: returns once
        every byte is copied) and serve it from the first bucket on; with `total` (their
        number) they are consumed one at a time, each copied as its bucket is cut."""
        if total is None:
            tensors = list(tensors)  # views: the copies are still made bucket by bucket
            total = len(tensors)
        snapshot = self.pool.take()
        self._serve(version, snapshot, snapshot.fill(tensors), total)

    def publish_snapshot(self, version: int, snapshot: Snapshot, tensors: list[RawTensor]) -> None:
        """Serve `tensors`, views of `snapshot` (taken from `self.pool`, filled by the
        caller), without copying them; the snapshot goes back to the pool once nothing
        can read this version any more."""
        self._serve(version, snapshot, tensors, len(tensors))

    def _serve(
        self, version: int, snapshot: Snapshot, tensors: Iterable[RawTensor], total: int
    ) -> None:
        """Offer `version` now and append its frames as `tensors` (views of `snapshot`)
        come; `snapshot` is given back when the version's FrameLog is freed."""
        log = FrameLog()
        weakref.finalize(log, self.pool.give_back, snapshot)  # see learner/snapshots.py
        if self.weight_socket is not None:
            self.weight_socket.purge()  # an expired ticket must not pin its snapshot
        with self._lock:
            self._version, self._encoded = version, log
        try:
            for frame in encode_bucket_parts(tensors, version, self.bucket_bytes, total):
                log.append(frame)
        except BaseException as exc:
            log.close(exc)  # streams of this version end with an error, not short
            raise
        log.close()

    @property
    def version(self) -> int:
        return self._version

    def close(self) -> None:
        if self.weight_socket is not None:
            self.weight_socket.stop()

    def GetVersion(self, request, context):
        return learner_pb2.GetVersionResponse(version=self._version)

    def _buckets(self, request: learner_pb2.FetchWeightsRequest, context) -> Iterable[Frame]:
        """The frames to stream, or abort the call."""
        return self._offered(request, context)[1]

    def _offered(self, request, context) -> tuple[int, Iterable[Frame]]:
        """(version, its frames) as `request` asks, or abort the call."""
        with self._lock:
            if self._encoded is None:
                abort(context, grpc.StatusCode.UNAVAILABLE, "no weights published yet")
                raise AssertionError("abort raises")
            if request.version not in (0, self._version):
                abort(
                    context,
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"version {request.version} not available (latest is {self._version})",
                )
            floor = min(MIN_BUCKET_BYTES, self.bucket_bytes)
            if 0 < request.bucket_bytes < floor:
                abort(
                    context,
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"bucket_bytes={request.bucket_bytes} < {floor} (the smallest served)",
                )
            version, log = self._version, self._encoded
        size = min(request.bucket_bytes or self.bucket_bytes, self.bucket_bytes)
        # A smaller size is re-cut per call, not cached: a copy per size asked would pile up.
        # Outside the lock: re-cutting waits for the version's publication to finish.
        return version, log if size == self.bucket_bytes else _recut(log, version, size)

    def OpenWeightSocket(self, request: learner_pb2.FetchWeightsRequest, context):
        """A one-time ticket for the buckets `request` names, on the weight socket."""
        if self.weight_socket is None:
            abort(
                context,
                grpc.StatusCode.UNIMPLEMENTED,
                "no weight socket (learner.publication.transport=grpc): use FetchWeights",
            )
            raise AssertionError("abort raises")
        version, buckets = self._offered(request, context)
        try:
            ticket = self.weight_socket.issue(buckets)
        except TooManyTickets as exc:
            abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, f"{exc}; try again shortly")
        return learner_pb2.WeightSocketTicket(
            version=version, port=self.weight_socket.port, ticket=ticket
        )

    def fetch_serialized(self, request: learner_pb2.FetchWeightsRequest, context):
        """Each frame joined into one serialized bucket (gRPC sends `bytes`: on this
        fallback path every fetch copies the version once)."""
        for frame in self._buckets(request, context):
            yield b"".join(frame)


def _recut(log: FrameLog, version: int, size: int) -> list[Frame]:
    """The version's buckets cut again at `size` (frames viewing a copy of its own)."""
    assembler = WeightAssembler()
    for frame in log:
        assembler.add(parse_bucket(b"".join(frame)))
    return list(encode_bucket_parts(assembler.result(), version, size))


def open_weight_socket(config: Any) -> WeightSocketServer | None:
    """The learner's weight socket when `learner.publication.transport` is 'socket' (started)."""
    learner = config.learner
    if learner.publication.transport != "socket":
        return None
    return WeightSocketServer(
        learner.server.host,
        learner.publication.socket_port,
        config.security.tls,
        io_timeout_s=config.shared.rpc.weights_timeout_s,
    ).start()


def add_weight_service(servicer: WeightServicer, server: grpc.Server) -> None:
    """Register `dapo.v1.WeightService` with FetchWeights streaming cached bytes."""
    handlers = {
        "GetVersion": grpc.unary_unary_rpc_method_handler(
            servicer.GetVersion,
            request_deserializer=learner_pb2.GetVersionRequest.FromString,
            response_serializer=learner_pb2.GetVersionResponse.SerializeToString,
        ),
        "FetchWeights": grpc.unary_stream_rpc_method_handler(
            servicer.fetch_serialized,
            request_deserializer=learner_pb2.FetchWeightsRequest.FromString,
            response_serializer=None,  # already bytes
        ),
        "OpenWeightSocket": grpc.unary_unary_rpc_method_handler(
            servicer.OpenWeightSocket,
            request_deserializer=learner_pb2.FetchWeightsRequest.FromString,
            response_serializer=learner_pb2.WeightSocketTicket.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("dapo.v1.WeightService", handlers),)
    )
