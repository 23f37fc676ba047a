"""Fuzzing the rollout service's gRPC methods against one real server (torch engine, tiny model).

Generate takes random prompts and sampling parameters; UpdateWeights takes updates that
are whole or spoiled one way (NaN/Inf values, wrong shape, dtype or name, missing or
reordered buckets, stale version); Pause/Resume/GetStatus and every method also take raw
bytes. A refusal is INVALID_ARGUMENT with a message (a pushed update reports
`applied=False` with an error); the served weights change exactly when an update is
applied, and then equal what was sent.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from fuzzing import Counter, assert_clear_refusal, cases, raw_call
from hypothesis import given
from hypothesis import strategies as st

from dapo.v1 import rollout_pb2, rollout_pb2_grpc, tensor_pb2
from rollout.server import RolloutServer
from rollout.torch_engine import TorchEngine
from services.common.config import DapoConfig
from services.common.grpc_server import insecure_channel
from services.common.tensor_codec import RawTensor, encode_buckets, from_torch

MAX_N, MAX_PROMPT, MAX_RESPONSE = 3, 10, 4
INT32 = st.integers(-(2**31), 2**31 - 1)
FLOATS = st.one_of(st.floats(-2, 3), st.floats(width=32), st.sampled_from([0.0, 1.0, 1e-30]))


@pytest.fixture(scope="module")
def served(tiny_model: Path) -> Iterator[tuple[RolloutServer, Any]]:
    config = DapoConfig.model_validate(
        {
            "shared": {"max_prompt_length": MAX_PROMPT, "max_response_length": MAX_RESPONSE},
            "rollout": {"server": {"grpc_port": 0, "http_port": 0}, "max_n": MAX_N},
        }
    )
    engine = TorchEngine(tiny_model, device="cpu", max_batch_size=8)
    server = RolloutServer(config, None, engine).start()
    channel = insecure_channel(f"127.0.0.1:{server.grpc_port}")
    yield server, channel
    channel.close()
    server.stop()


# -- Generate ----------------------------------------------------------------------------


# Each field either plausible or wild; a request is wild in one field at most half the
# time, so plenty of them get through to the engine too.
PLAUSIBLE = {
    "n": st.integers(1, MAX_N),
    "top_p": st.floats(0.05, 1.0),
    "top_k": st.integers(-1, 20),
    "max_tokens": st.integers(0, MAX_RESPONSE),
    "stop_token_ids": st.lists(st.integers(0, 13), max_size=2),
    "temperature": st.floats(0, 2),
    "prompt_token_ids": st.lists(st.integers(0, 13), min_size=1, max_size=MAX_PROMPT),
}
WILD = {
    "n": st.integers(0, MAX_N + 1),
    "top_p": FLOATS,
    "top_k": INT32,
    "max_tokens": st.integers(0, 2**32 - 1),
    "stop_token_ids": st.lists(INT32, max_size=3),
    "temperature": FLOATS,
    "prompt_token_ids": st.lists(st.one_of(st.integers(-2, 40), INT32), max_size=MAX_PROMPT + 2),
}


@st.composite
def generate_requests(draw: st.DrawFn) -> rollout_pb2.GenerateRequest:
    wild = draw(st.sampled_from([None, None, *WILD]))
    value = {k: draw(WILD[k] if k == wild else PLAUSIBLE[k]) for k in PLAUSIBLE}
    sampling = rollout_pb2.SamplingParams(
        top_p=value["top_p"], top_k=value["top_k"], max_tokens=value["max_tokens"],
        stop_token_ids=value["stop_token_ids"], seed=draw(st.integers(0, 2**64 - 1)),
    )  # fmt: skip
    if draw(st.booleans()):
        sampling.temperature = value["temperature"]
    text = st.text(st.characters(exclude_categories=["Cs"]), max_size=MAX_PROMPT + 2)
    request = rollout_pb2.GenerateRequest(
        request_id=draw(st.text(st.characters(exclude_categories=["Cs"]), max_size=8)),
        prompt=draw(text),
        apply_chat_template=draw(st.booleans()),
        n=value["n"],
        sampling=sampling,
    )
    if draw(st.integers(0, 3)):  # token ids mostly; else the text is tokenised
        request.prompt_token_ids.extend(value["prompt_token_ids"])
    return request


def test_fuzz_generate(served: tuple[RolloutServer, Any]) -> None:
    server, channel = served
    stub = rollout_pb2_grpc.RolloutServiceStub(channel)
    seen, accepted = Counter(), Counter()
    refusals: dict[str, int] = {}

    @cases(300)
    @given(request=generate_requests())
    def run(request: rollout_pb2.GenerateRequest) -> None:
        seen()
        try:
            replies = list(stub.Generate(request, timeout=60))
        except grpc.RpcError as exc:
            reason = (exc.details() or "").split(":")[0][:60]
            refusals[reason] = refusals.get(reason, 0) + 1
            assert_clear_refusal(exc)
            return
        accepted()
        assert sorted(r.sample_index for r in replies) == list(range(request.n))
        limit = request.sampling.max_tokens or MAX_RESPONSE
        for reply in replies:
            completion = reply.completion
            assert 1 <= len(completion.token_ids) == len(completion.logprobs) <= limit
            assert all(math.isfinite(lp) and lp <= 1e-6 for lp in completion.logprobs)

    run()
    # Many must get through too (about half do; the margin absorbs shrinking's extra calls).
    assert seen.n >= 300 and accepted.n > 50, (seen.n, accepted.n, refusals)
    assert server.servicer.in_flight == 0


# -- UpdateWeights ------------------------------------------------------------------------

SPOILERS = ["nan", "inf", "shape", "dtype", "name", "truncate", "reorder", "stale", "none"]


def spoil_tensor(kind: str, t: torch.Tensor, position: int) -> torch.Tensor:
    """One tensor made wrong in the way `kind` names."""
    if kind in ("nan", "inf"):
        bad = t.clone().view(-1)
        bad[position % bad.numel()] = math.nan if kind == "nan" else -math.inf
        return bad.view(t.shape)
    if kind == "shape":
        return t.reshape(1, *t.shape)
    return t.to(torch.float64)  # dtype


def build_update(
    params: dict[str, torch.Tensor], kind: str, which: int, position: int, version: int
) -> list[tensor_pb2.WeightBucket]:
    names = sorted(params)
    name = names[which % len(names)]
    tensors: list[RawTensor] = []
    for n in names:
        t = params[n] + 0.01 * (version % 7 + 1)
        if n == name and kind in ("nan", "inf", "shape", "dtype"):
            t = spoil_tensor(kind, t, position)
        tensors.append(from_torch("model.not.a.weight" if n == name and kind == "name" else n, t))
    buckets = list(encode_buckets(tensors, version if kind != "stale" else 0, 16384))
    if kind == "truncate":
        buckets = buckets[:-1]
    if kind == "reorder" and len(buckets) > 1:
        buckets[0], buckets[1] = buckets[1], buckets[0]
    return buckets


def served_weights(engine: TorchEngine) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in engine.model.state_dict().items()}


def test_fuzz_update_weights(served: tuple[RolloutServer, Any]) -> None:
    server, channel = served
    stub = rollout_pb2_grpc.RolloutServiceStub(channel)
    engine: TorchEngine = server.engine  # type: ignore[assignment]
    names = sorted(dict(engine.model.named_parameters()))
    seen = Counter()

    @cases(120)
    @given(
        kind=st.sampled_from(SPOILERS),
        which=st.integers(0, len(names) - 1),
        position=st.integers(0, 2**20),
    )
    def run(kind: str, which: int, position: int) -> None:
        seen()
        before, version = served_weights(engine), engine.version
        params = {n: before[n] for n in names}
        buckets = build_update(params, kind, which, position, version + 1)
        reply = stub.UpdateWeights(iter(buckets), timeout=60)
        after = served_weights(engine)
        if kind == "none":
            assert reply.applied and reply.version == version + 1 == engine.version
            sent = {n: params[n] + 0.01 * ((version + 1) % 7 + 1) for n in names}
            assert all(torch.equal(after[n], sent[n]) for n in names)
            return
        assert not reply.applied and reply.error.strip(), (kind, reply)
        assert reply.version == version == engine.version
        assert all(torch.equal(after[n], before[n]) for n in before), f"{kind} changed weights"

    run()
    assert seen.n >= 120


# -- control methods and raw bytes ----------------------------------------------------------

METHODS = ["Generate", "Pause", "Resume", "GetStatus", "UpdateWeights"]


def test_fuzz_raw_bytes_to_every_unary_method(served: tuple[RolloutServer, Any]) -> None:
    server, channel = served
    seen = Counter()

    @cases(400)
    @given(method=st.sampled_from(METHODS), data=st.binary(max_size=48))
    def run(method: str, data: bytes) -> None:
        seen()
        path = f"/dapo.v1.RolloutService/{method}"
        try:
            if method == "Generate":
                list(channel.unary_stream(path)(data, timeout=60))
            elif method == "UpdateWeights":
                reply = channel.stream_unary(path)(iter([data, data]), timeout=60)
                assert not rollout_pb2.UpdateWeightsResponse.FromString(reply).applied
            else:
                raw_call(channel, path, data, timeout=60)
        except grpc.RpcError as exc:
            assert_clear_refusal(exc, grpc.StatusCode.INVALID_ARGUMENT)
        finally:
            if method == "Pause":
                raw_call(channel, "/dapo.v1.RolloutService/Resume", b"")

    run()
    assert seen.n >= 400
    status = rollout_pb2_grpc.RolloutServiceStub(channel).GetStatus(
        rollout_pb2.GetStatusRequest(), timeout=10
    )
    assert not status.paused and status.requests_in_flight == 0
