"""The learner's WeightService: rollout servers pull the latest weights from here.

A snapshot is taken after each committed step (bytes on CPU), so a fetch streams a
consistent version even while the next step trains. The buckets of a version are
serialized once, on its first fetch, and every later fetch (R rollout servers) streams
the same bytes: `add_weight_service` registers FetchWeights with a pass-through
serializer, so the wire format is exactly the generated `WeightBucket` messages.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import grpc
import torch

from dapo.v1 import learner_pb2, learner_pb2_grpc
from services.common.tensor_codec import RawTensor, encode_buckets, from_torch


def snapshot(named: Iterable[tuple[str, torch.Tensor]]) -> list[RawTensor]:
    """Copy weights to CPU bytes."""
    return [from_torch(name, tensor) for name, tensor in named]


class WeightServicer(learner_pb2_grpc.WeightServiceServicer):
    """Serves the latest published snapshot."""

    def __init__(self, bucket_bytes: int) -> None:
        self.bucket_bytes = bucket_bytes
        self._lock = threading.Lock()
        self._version = 0
        self._tensors: list[RawTensor] = []
        self._encoded: dict[tuple[int, int], list[bytes]] = {}

    def publish(self, version: int, tensors: list[RawTensor]) -> None:
        with self._lock:
            self._version, self._tensors, self._encoded = version, tensors, {}

    @property
    def version(self) -> int:
        return self._version

    def GetVersion(self, request, context):
        return learner_pb2.GetVersionResponse(version=self._version)

    def _checked(self, request: learner_pb2.FetchWeightsRequest, context) -> tuple[int, int]:
        """(version, bucket size) to serve, or abort the call."""
        if not self._tensors:
            context.abort(grpc.StatusCode.UNAVAILABLE, "no weights published yet")
        if request.version not in (0, self._version):
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"version {request.version} not available (latest is {self._version})",
            )
        return self._version, min(request.bucket_bytes or self.bucket_bytes, self.bucket_bytes)

    def FetchWeights(self, request: learner_pb2.FetchWeightsRequest, context):
        """Buckets as messages (for servers registered with the generated helper)."""
        with self._lock:
            version, size = self._checked(request, context)
            tensors = self._tensors
        yield from encode_buckets(tensors, version, size)

    def fetch_serialized(self, request: learner_pb2.FetchWeightsRequest, context):
        """Buckets as serialized bytes, encoded once per (version, bucket size)."""
        with self._lock:
            key = self._checked(request, context)
            if key not in self._encoded:
                buckets = encode_buckets(self._tensors, *key)
                self._encoded[key] = [b.SerializeToString() for b in buckets]
            encoded = self._encoded[key]
        yield from encoded


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
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("dapo.v1.WeightService", handlers),)
    )
