"""The learner's WeightService: rollout servers pull the latest weights from here.

A snapshot is taken after each committed step (bytes on CPU), so a fetch streams a
consistent version even while the next step trains.
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

    def publish(self, version: int, tensors: list[RawTensor]) -> None:
        with self._lock:
            self._version, self._tensors = version, tensors

    @property
    def version(self) -> int:
        return self._version

    def GetVersion(self, request, context):
        return learner_pb2.GetVersionResponse(version=self._version)

    def FetchWeights(self, request: learner_pb2.FetchWeightsRequest, context):
        with self._lock:
            version, tensors = self._version, self._tensors
        if not tensors:
            context.abort(grpc.StatusCode.UNAVAILABLE, "no weights published yet")
        if request.version not in (0, version):
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"version {request.version} not available (latest is {version})",
            )
        size = min(request.bucket_bytes or self.bucket_bytes, self.bucket_bytes)
        yield from encode_buckets(tensors, version, size)
