"""Fuzzing the weight updates a rollout server pulls, on a real server (torch engine,
tiny model).

Updates go in as the weight sync applies what it pulled from the learner: serialized
buckets, parsed in place (`parse_bucket`), then `WeightUpdater.apply`. Each case is a
whole update (the served weights shifted, next version), or one spoiled in one way: a
NaN/Inf value, a wrong shape, dtype or name, a stale version, or a broken wire stream
(missing, repeated or reordered buckets, mixed versions, wrong sizes, offsets, dtype
enums, cut data). A spoiled update must be refused with a ValueError (what the weight
sync expects) naming its problem, and leave the served weights bit-identical and the
version as it was; a whole one must be applied exactly. Raw bytes streams follow.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fuzzing import (
    EXAMPLES,
    Counter,
    decodes,
    fuzz,
    serve_rollout,
    wire_bytes,
)
from hypothesis import strategies as st

from dapo.v1 import rollout_pb2, tensor_pb2
from rollout.server import RolloutServer
from rollout.torch_engine import TorchEngine
from services.weight_transport.assembly import Assembling
from services.weight_transport.tensor_codec import RawTensor, encode_buckets
from services.weight_transport.torch_codec import from_torch

BUCKET_BYTES = [8192, 16384, 65536]  # the tiny model's ~500 KB: 62, 31 or 8 buckets
Buckets = list[tensor_pb2.WeightBucket]


@pytest.fixture(scope="module")
def served(tiny_model: Path) -> Iterator[tuple[RolloutServer, Any]]:
    yield from serve_rollout(tiny_model)


# -- spoiling one tensor -----------------------------------------------------------------------


def spoil_value(kind: str, t: torch.Tensor, at: int) -> torch.Tensor:
    """NaN or +-Inf at one element."""
    bad = t.clone().view(-1)
    bad[at % bad.numel()] = math.nan if kind == "nan" else (-1) ** at * math.inf
    return bad.view(t.shape)


def spoil_shape(t: torch.Tensor, at: int) -> torch.Tensor:
    shapes = [(1, *t.shape), (*t.shape, 1), (t.numel() - 1,)]
    shape = shapes[at % len(shapes)]
    return t.reshape(-1)[: math.prod(shape)].reshape(shape)


def spoil_dtype(t: torch.Tensor, at: int) -> torch.Tensor:
    return t.to([torch.float64, torch.float16, torch.bfloat16, torch.int32][at % 4])


def spoil_name(name: str, at: int) -> str:
    return ["model.not.a.weight", "", name + ".x", name.upper()][at % 4]


TENSOR_SPOILERS: dict[str, Callable[[torch.Tensor, int], torch.Tensor]] = {
    "nan": lambda t, at: spoil_value("nan", t, at),
    "inf": lambda t, at: spoil_value("inf", t, at),
    "shape": spoil_shape,
    "dtype": spoil_dtype,
}


def tensors_of(
    params: dict[str, torch.Tensor], kind: str, which: int, at: int, shift: float
) -> list[RawTensor]:
    """The shifted weights, with tensor `which` spoiled as `kind` says (if a tensor kind)."""
    names = sorted(params)
    target = names[which % len(names)]
    out = []
    for name in names:
        t, sent_name = params[name] + shift, name
        if name == target and kind in TENSOR_SPOILERS:
            t = TENSOR_SPOILERS[kind](t, at)
        if name == target and kind == "name":
            sent_name = spoil_name(name, at)
        if name == target and kind == "dup_name":  # the name of another tensor
            sent_name = names[(which + 1 + at % (len(names) - 1)) % len(names)]
        out.append(from_torch(sent_name, t))
    return out


# -- spoiling the stream of buckets ---------------------------------------------------------------


def _slice(buckets: Buckets, i: int, at: int) -> tensor_pb2.TensorSlice:
    """One slice that carries data (a last bucket may carry none)."""
    slices = [s for b in buckets for s in b.slices if s.data]
    return slices[(i + at) % len(slices)]


def _add(message: Any, field: str, delta: int) -> None:
    setattr(message, field, getattr(message, field) + delta)


def _cut(piece: tensor_pb2.TensorSlice) -> None:
    piece.data = piece.data[:-1]


def _repeat(buckets: Buckets, i: int) -> Buckets:
    return buckets[: i + 1] + [buckets[i]] + buckets[i + 1 :]


STREAM_SPOILERS: dict[str, Callable[[Buckets, int, int], Buckets | None]] = {
    "empty": lambda b, i, at: [],
    "drop": lambda b, i, at: b[:i] + b[i + 1 :],
    "repeat": lambda b, i, at: _repeat(b, i),
    "index": lambda b, i, at: _add(b[i], "index", 1 + at % 5),
    "version": lambda b, i, at: _add(b[i], "version", 1 + at),
    "last_early": lambda b, i, at: setattr(b[i % (len(b) - 1)], "last", True),
    "total_tensors": lambda b, i, at: _add(b[i], "total_tensors", 1),
    "total_bytes": lambda b, i, at: _add(_slice(b, i, at), "total_bytes", 1 + at % 7),
    "offset": lambda b, i, at: _add(_slice(b, i, at), "offset", 1 + at % 7),
    "dtype_enum": lambda b, i, at: setattr(_slice(b, i, at), "dtype", 11 + at % 100),
    "negative_dim": lambda b, i, at: _slice(b, i, at).shape.append(-1 - at % 3),
    "cut_data": lambda b, i, at: _cut(_slice(b, i, at)),
}
# Words the refusal must hold, for each way of spoiling an update.
EXPECTED = {
    "nan": ["NaN or infinite"],
    "inf": ["NaN or infinite"],
    "shape": ["has shape"],
    "dtype": ["has dtype"],
    "name": ["unknown weight"],
    "dup_name": ["changed between slices", "does not follow", "update holds"],
    "stale": ["not newer"],
    "empty": ["update incomplete"],
    "drop": ["out of order", "update incomplete"],
    "repeat": ["out of order", "after the last one"],
    "index": ["out of order"],
    "version": ["bucket for version"],
    "last_early": ["after the last one"],
    "total_tensors": ["announce"],
    "total_bytes": ["total_bytes"],
    "offset": ["does not follow"],
    "dtype_enum": ["unknown dtype enum"],
    "negative_dim": ["negative dimension"],
    "cut_data": ["does not follow", "incomplete tensors"],
    "none": [],
}


def shift(version: int) -> float:
    """What version `version` adds to the weights: +-0.01 in turn, so they stay bounded."""
    return 0.01 if version % 2 else -0.01


def build_update(params: dict[str, torch.Tensor], kind: str, at: int, version: int) -> Buckets:
    """The weights of `version` (params + shift), spoiled as `kind` says."""
    tensors = tensors_of(params, kind, at // 7, at, shift(version))
    sent_version = version if kind != "stale" else at % version
    buckets = list(encode_buckets(tensors, sent_version, BUCKET_BYTES[at % 3]))
    if kind in STREAM_SPOILERS:
        spoiled = STREAM_SPOILERS[kind](buckets, (at // 3) % len(buckets), at)
        buckets = buckets if spoiled is None else spoiled
    return buckets


def served_weights(engine: TorchEngine) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in engine.model.state_dict().items()}


def load(server: RolloutServer, frames: list[bytes]) -> tuple[int, str]:
    """(version served, error or ""): the frames parsed and applied as the sync does."""
    try:
        return server.updater.apply(Assembling.of_frames(frames)), ""
    except ValueError as exc:  # TensorWireError and StaleUpdate included
        assert str(exc).strip(), f"{type(exc).__name__} without a message"
        return server.engine.version, str(exc)


def generate_one(channel: Any) -> rollout_pb2.GenerateGroupResponse:
    call = channel.unary_unary(
        "/dapo.v1.RolloutService/GenerateGroup",
        request_serializer=rollout_pb2.GenerateRequest.SerializeToString,
        response_deserializer=rollout_pb2.GenerateGroupResponse.FromString,
    )
    return call(TINY, timeout=60)


def test_fuzz_update_weights(served: tuple[RolloutServer, Any]) -> None:
    server, channel = served
    engine: TorchEngine = server.engine  # type: ignore[assignment]
    names = sorted(dict(engine.model.named_parameters()))
    applied = Counter()

    def check(kind: str, at: int) -> None:
        before, version = served_weights(engine), engine.version
        params = {n: before[n] for n in names}
        buckets = build_update(params, kind, at, version + 1)
        served_version, error = load(server, [b.SerializeToString() for b in buckets])
        after = served_weights(engine)
        if kind == "none":
            applied()
            assert not error and served_version == version + 1 == engine.version, error
            sent = {n: params[n] + shift(version + 1) for n in names}
            assert all(torch.equal(after[n], sent[n]) for n in names)
            return
        assert error, (kind, "applied")
        assert any(w in error for w in EXPECTED[kind]), (kind, error)
        assert served_version == version == engine.version
        assert all(torch.equal(after[n], before[n]) for n in before), f"{kind} changed weights"

    fuzz(check, kind=st.sampled_from(list(EXPECTED)), at=st.integers(0, 2**20))
    assert applied.n >= EXAMPLES // 40, applied.n  # ~1 in 20 is whole
    generated = generate_one(channel)  # the server still samples
    assert generated.completions[0].policy_version == engine.version


TINY = rollout_pb2.GenerateRequest(
    prompt_token_ids=[1, 2], n=1, sampling=rollout_pb2.SamplingParams(max_tokens=1)
)


# -- raw bytes -----------------------------------------------------------------------------------

NAMES = ["model.norm.weight", "model.embed_tokens.weight", "x", ""]
BUCKETS = st.builds(
    tensor_pb2.WeightBucket,
    version=st.one_of(st.integers(0, 100), st.integers(0, 2**64 - 1)),
    index=st.integers(0, 2),
    last=st.booleans(),
    total_tensors=st.integers(0, 2),
    slices=st.lists(
        st.builds(
            tensor_pb2.TensorSlice,
            name=st.sampled_from(NAMES),
            dtype=st.integers(0, 11),
            shape=st.lists(st.integers(-1, 4), max_size=2),
            offset=st.integers(0, 8),
            total_bytes=st.integers(0, 64),
            data=st.binary(max_size=16),
        ),
        max_size=2,
    ),
)
WHOLE = BUCKETS.map(lambda m: m.SerializeToString())


def test_fuzz_update_weights_raw_bytes(served: tuple[RolloutServer, Any]) -> None:
    """Streams of 1-3 frames, each a bucket (whole or spoiled) or random bytes. Whatever
    is refused (a ValueError: the weight sync's hand-written parser must not raise
    anything else on bytes protobuf cannot decode) leaves weights and version alone;
    whatever is applied moved the version forward and changed only tensors the stream
    named."""
    server, channel = served
    engine: TorchEngine = server.engine  # type: ignore[assignment]
    refused = Counter()

    def check(stream: list[bytes]) -> None:
        before, version = served_weights(engine), engine.version
        served_version, error = load(server, stream)
        after = served_weights(engine)
        if error:
            refused()
            assert served_version == version == engine.version
            assert all(torch.equal(after[n], before[n]) for n in before)
            return
        assert all(decodes(tensor_pb2.WeightBucket, m) for m in stream)
        assert served_version == engine.version > version
        named = {s.name for m in stream for s in tensor_pb2.WeightBucket.FromString(m).slices}
        assert all(torch.equal(after[n], before[n]) for n in before if n not in named)

    fuzz(check, stream=st.lists(st.one_of(WHOLE, wire_bytes(BUCKETS)), min_size=1, max_size=3))
    assert refused.n >= EXAMPLES * 9 // 10, refused.n
