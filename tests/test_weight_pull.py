"""One weight pull (rollout/weights.py `pull`): the first source that offers an update is
the one received; a fallible source (a relay) that breaks off hands over to the next,
any other source's error is the pull's; a receiver that gives up abandons the buckets."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from rollout.engine import SamplingParams, StreamedSample
from rollout.engine_base import EngineBase
from rollout.metrics import RolloutMetrics
from rollout.weights import StaleUpdate, WeightSource, WeightUpdater, WholeUpdate, pull
from services.weight_transport.assembly import Assembled, AssembledBuckets, Assembling
from services.weight_transport.frame_reader import PlacedBuckets
from services.weight_transport.tensor_codec import encode_bucket_bytes, encode_buckets
from services.weight_transport.torch_codec import from_torch
from services.weight_transport.weight_socket import FRAME, WeightSocketError

TENSORS = {"a": torch.arange(6, dtype=torch.float32), "b": torch.ones(3, 4)}
VERSION = 4


def _raw() -> list[Any]:
    return [from_torch(n, t) for n, t in TENSORS.items()]


class Breaking(AssembledBuckets):
    """An update whose transfer breaks off after its first bucket (a relay parent that
    died); records what the receiver abandoned it with."""

    def __init__(self) -> None:
        self._inner = Assembling(encode_buckets(_raw(), VERSION, bucket_bytes=32))
        self.assembler = self._inner.assembler
        self.abandoned: list[BaseException] = []

    def __iter__(self) -> Iterator[Assembled]:
        for item in self._inner:
            yield item
            raise WeightSocketError("parent went away")

    def abandon(self, error: BaseException) -> None:
        self.abandoned.append(error)

    def close(self) -> None:
        """Nothing to release (no transport)."""


@dataclass
class Source:
    """A weight source offering `make()`'s buckets (nothing when `make` is None)."""

    name: str
    make: Any = None
    fallible: bool = False
    asked: int = 0
    handed: list[AssembledBuckets] = field(default_factory=list)

    def fetch(self) -> AssembledBuckets | None:
        self.asked += 1
        if self.make is None:
            return None
        self.handed.append(self.make())
        return self.handed[-1]


def whole() -> AssembledBuckets:
    return Assembling(encode_buckets(_raw(), VERSION, bucket_bytes=32))


def _tensors(update: tuple[int, list[Any]]) -> tuple[int, dict[str, bytes]]:
    version, raws = update
    return version, {t.name: bytes(t.data) for t in raws}


EXPECTED = (VERSION, {t.name: bytes(t.data) for t in _raw()})


def test_the_first_source_that_offers_is_received_and_later_ones_never_asked() -> None:
    absent, stream, later = Source("socket"), Source("stream", whole), Source("x", whole)
    sources: list[WeightSource] = [absent, stream, later]
    name, update = pull(sources, WholeUpdate())
    assert (name, _tensors(update)) == ("stream", EXPECTED)
    assert (absent.asked, stream.asked, later.asked) == (1, 1, 0)
    with pytest.raises(LookupError, match="no weight source"):
        pull([absent], WholeUpdate())


def test_a_fallible_source_that_breaks_off_hands_over_to_the_next() -> None:
    relay, learner = Source("relay", Breaking, fallible=True), Source("stream", whole)
    name, update = pull([relay, learner], WholeUpdate())
    assert (name, _tensors(update)) == ("stream", EXPECTED)
    assert (relay.asked, learner.asked) == (1, 1)


def test_another_sources_break_is_the_pulls_error() -> None:
    socket_source, learner = Source("socket", Breaking), Source("stream", whole)
    with pytest.raises(WeightSocketError, match="parent went away"):
        pull([socket_source, learner], WholeUpdate())
    assert learner.asked == 0


class VersionOnly(EngineBase):
    """An engine that keeps only the version of what it loads."""

    tokenizer = None

    def _samples(
        self, prompts: list[list[int]], params: SamplingParams, seed: int
    ) -> Iterator[StreamedSample]:
        raise NotImplementedError  # never generates

    def load_weights(self, named_tensors: Any, version: int, owned: bool = False) -> None:
        with self._swap(version):
            list(named_tensors)


def test_the_updater_abandons_what_breaks_off_and_loads_from_the_next_source() -> None:
    engine = VersionOnly(vocab_size=10)
    relay, learner = Source("relay", Breaking, fallible=True), Source("stream", whole)
    assert pull([relay, learner], WeightUpdater(engine, RolloutMetrics())) == (
        "stream",
        VERSION,
    )
    assert engine.version == VERSION
    (error,) = relay.handed[0].abandoned  # type: ignore[attr-defined]
    assert isinstance(error, WeightSocketError)


def test_a_refused_update_closes_its_weight_socket_at_once() -> None:
    """A stale version is refused at its first bucket; abandoning the buckets closes the
    socket then, so the learner's sender stops (before `abandon`, CPython's reference
    counting closed it too, when the dropped iterator was finalized: now it is said)."""
    reader, writer = socket.socketpair()
    frames = list(encode_bucket_bytes(_raw(), VERSION, 32))

    def send() -> None:
        with writer, contextlib.suppress(OSError):  # the reader hangs up early
            for frame in frames:
                writer.sendall(FRAME.pack(len(frame)) + frame)
            writer.sendall(FRAME.pack(0))

    threading.Thread(target=send, daemon=True).start()
    reader.settimeout(10)
    placed = PlacedBuckets(reader, 1 << 20)
    updater = WeightUpdater(VersionOnly(vocab_size=10, version=VERSION), RolloutMetrics())
    with pytest.raises(StaleUpdate) as refused:
        updater.apply(placed)
    assert refused.value.__traceback__ is not None  # the frames (and iterator) still held
    assert reader.fileno() == -1  # closed
