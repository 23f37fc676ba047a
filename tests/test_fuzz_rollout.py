"""Fuzzing the rollout service's GenerateGroup(s) and GetStatus.

One real server (torch engine, tiny model, tiny limits so a case costs milliseconds).
Each GenerateGroup request is generated plausible or wild in one field, and its verdict
is derived from the request itself (`problems`): a request within limits must be
answered in full; any other must be refused with INVALID_ARGUMENT (UNAVAILABLE for a
`min_version` not served) whose message names one of its problems. Nothing depends on
load: calls are sequential, so busy refusals cannot happen unless the server leaks a
call. Every method also takes 1000 raw byte strings and 1000 structurally wrong
messages (another RPC's message type; repeated fields and strings far over the limits);
GetStatus must always match the server's state. The weight updates the server pulls are
fuzzed in tests/test_fuzz_rollout_weights.py.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from fuzzing import (
    EXAMPLES,
    ROLLOUT_MAX_N,
    ROLLOUT_MAX_PROMPT,
    ROLLOUT_MAX_REQUEST_BYTES,
    ROLLOUT_MAX_RESPONSE,
    STRUCTURE_BYTES,
    assert_clear_refusal,
    decodes,
    fuzz,
    raw_call,
    serve_rollout,
    wire_bytes,
)
from hypothesis import strategies as st

from dapo.v1 import rollout_pb2
from rollout.engine import MIN_TEMPERATURE
from rollout.server import RolloutServer
from services.common.adapters import sample_from_completion
from services.common.grpc_server import MAX_DETAILS_CHARS, bounded_details

SERVICE = "/dapo.v1.RolloutService"
INVALID, UNAVAILABLE = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAVAILABLE
FAILED = grpc.StatusCode.FAILED_PRECONDITION
INT32 = st.integers(-(2**31), 2**31 - 1)
FLOATS = st.one_of(st.floats(-2, 3), st.floats(width=32), st.sampled_from([0.0, 1.0, 1e-30]))
UNICODE = st.characters(exclude_categories=["Cs"])
# Another tokenizer's fingerprint now and then (empty: not checked).
FINGERPRINTS = st.sampled_from(["", "", "", "", "0123456789abcdef"])


@pytest.fixture(scope="module")
def served(tiny_model: Path) -> Iterator[tuple[RolloutServer, Any]]:
    yield from serve_rollout(tiny_model)


# -- the verdict a request must get ----------------------------------------------------------


def prompt_ids(request: rollout_pb2.GenerateRequest) -> list[int]:
    """The prompt the server must sample from: the ids as sent (it never tokenizes)."""
    return list(request.prompt_token_ids)


def prompt_problems(prompt: list[int], vocab: int) -> list[str]:
    if not prompt:
        return ["prompt is empty"]
    too_long = ["shared.max_prompt_length"] if len(prompt) > ROLLOUT_MAX_PROMPT else []
    outside = ["outside the vocabulary"] if any(not 0 <= t < vocab for t in prompt) else []
    return too_long + outside


def sampling_problems(sampling: rollout_pb2.SamplingParams) -> list[str]:
    """Server defaults: temperature 1, top_p 1 (zero), top_k off (<= 0), max_tokens limit."""
    out = []
    if sampling.max_tokens > ROLLOUT_MAX_RESPONSE:
        out.append("shared.max_response_length")
    temperature = sampling.temperature if sampling.HasField("temperature") else 1.0
    if not (temperature == 0 or MIN_TEMPERATURE <= temperature < math.inf):
        out.append("temperature must be")
    if not 0 < (sampling.top_p or 1.0) <= 1:
        out.append("top_p must be")
    return out


def problems(
    request: rollout_pb2.GenerateRequest, tokenizer: Any, version: int
) -> list[tuple[grpc.StatusCode, str]]:
    """(code, words its message must hold) for each reason to refuse; [] = must answer."""
    found = ["rollout.max_request_bytes"] if request.ByteSize() > ROLLOUT_MAX_REQUEST_BYTES else []
    found += [] if 1 <= request.n <= ROLLOUT_MAX_N else ["rollout.max_n"]
    found += sampling_problems(request.sampling)
    found += prompt_problems(prompt_ids(request), len(tokenizer))
    out = [(INVALID, words) for words in found]
    if request.tokenizer_fingerprint:  # the strategy never draws the server's own
        out.append((FAILED, "tokenized by tokenizer"))
    if request.min_version > version:
        out.append((UNAVAILABLE, f"the request needs >= {request.min_version}"))
    return out


# -- calling and checking -------------------------------------------------------------------


def call(channel: Any, data: bytes) -> tuple[str, list[int], list[Any]]:
    """(request id, prompt ids, completions in sample order) from GenerateGroup."""
    decode = rollout_pb2.GenerateGroupResponse.FromString
    method = channel.unary_unary(f"{SERVICE}/GenerateGroup", response_deserializer=decode)
    group = method(data, timeout=60)
    return group.request_id, list(group.prompt_token_ids), list(group.completions)


def check_completion(c: Any, request: rollout_pb2.GenerateRequest, stops: set[int]) -> None:
    limit = request.sampling.max_tokens or ROLLOUT_MAX_RESPONSE
    s = sample_from_completion(c)
    assert 1 <= len(s.token_ids) == len(s.logprobs) <= limit, c
    assert all(math.isfinite(lp) and lp <= 1e-6 for lp in s.logprobs.tolist()), c
    if c.finish_reason == rollout_pb2.FINISH_REASON_STOP:
        assert int(s.token_ids[-1]) in stops | set(request.sampling.stop_token_ids), c
    else:
        assert c.finish_reason == rollout_pb2.FINISH_REASON_LENGTH and len(s.token_ids) == limit


class Verdicts:
    """Checks each GenerateGroup outcome against `problems`; tallies them."""

    def __init__(self, server: RolloutServer, channel: Any) -> None:
        self.server, self.channel = server, channel
        self.tokenizer = server.engine.tokenizer  # type: ignore[attr-defined]
        self.stops = set(server.engine.eos_token_ids)  # type: ignore[attr-defined]
        self.accepted = 0
        self.refused: dict[str, int] = {}  # reason named -> count

    def check(self, request: rollout_pb2.GenerateRequest, data: bytes) -> None:
        version = self.server.engine.version
        expected = problems(request, self.tokenizer, version)
        try:
            request_id, prompt, completions = call(self.channel, data)
        except grpc.RpcError as exc:
            self.refusal(exc, expected)
            return
        assert not expected, f"answered despite {expected}: {request}"
        self.accepted += 1
        assert request_id == request.request_id
        assert prompt == prompt_ids(request)
        assert len(completions) == request.n
        for completion in completions:
            check_completion(completion, request, self.stops)
            assert completion.policy_version == version

    def refusal(self, exc: grpc.RpcError, expected: list[tuple[grpc.StatusCode, str]]) -> None:
        assert_clear_refusal(exc, INVALID, UNAVAILABLE, FAILED)
        assert expected, f"refused a request within limits: {exc.code()} {exc.details()}"
        named = [words for code, words in expected if code == exc.code() and words in exc.details()]
        assert named, f"{exc.code()} {exc.details()!r} names none of {expected}"
        reason = named[0].split(" >=")[0]  # min_version refusals: one tally
        self.refused[reason] = self.refused.get(reason, 0) + 1


# -- GenerateGroup ---------------------------------------------------------------

# Each field either plausible or wild; a request is wild in one field at most half the
# time, so plenty of them get through to the engine too. Cheap: n <= 3, max_tokens <= 4,
# prompts <= 10 tokens.
PLAUSIBLE = {
    "n": st.integers(1, ROLLOUT_MAX_N),
    "top_p": st.floats(0.05, 1.0),
    "top_k": st.integers(-1, 20),
    "max_tokens": st.integers(0, ROLLOUT_MAX_RESPONSE),
    "stop_token_ids": st.lists(st.integers(0, 13), max_size=2),
    "temperature": st.floats(0, 2),
    "prompt_token_ids": st.lists(st.integers(0, 13), min_size=1, max_size=ROLLOUT_MAX_PROMPT),
    "min_version": st.just(0),
}
WILD = {
    "n": st.integers(0, 2**32 - 1),
    "top_p": FLOATS,
    "top_k": INT32,
    "max_tokens": st.integers(0, 2**32 - 1),
    "stop_token_ids": st.lists(INT32, max_size=3),
    "temperature": FLOATS,
    "prompt_token_ids": st.lists(
        st.one_of(st.integers(-2, 40), INT32), max_size=ROLLOUT_MAX_PROMPT + 2
    ),
    "min_version": st.integers(0, 2**64 - 1),
}


@st.composite
def generate_requests(draw: st.DrawFn) -> rollout_pb2.GenerateRequest:
    wild = draw(st.sampled_from([None, None, *WILD]))
    value = {k: draw(WILD[k] if k == wild else PLAUSIBLE[k]) for k in PLAUSIBLE}
    sampling = rollout_pb2.SamplingParams(
        top_p=value["top_p"],
        top_k=value["top_k"],
        max_tokens=value["max_tokens"],
        stop_token_ids=value["stop_token_ids"],
        seed=draw(st.integers(0, 2**64 - 1)),
    )
    if draw(st.booleans()):
        sampling.temperature = value["temperature"]
    request = rollout_pb2.GenerateRequest(
        request_id=draw(st.text(UNICODE, max_size=8)),
        prompt_token_ids=value["prompt_token_ids"],
        tokenizer_fingerprint=draw(FINGERPRINTS),
        n=value["n"],
        sampling=sampling,
        min_version=value["min_version"],
    )
    return request


def test_fuzz_generate_group(served: tuple[RolloutServer, Any]) -> None:
    server, channel = served
    verdicts = Verdicts(server, channel)

    def check(request: rollout_pb2.GenerateRequest) -> None:
        verdicts.check(request, request.SerializeToString())

    fuzz(check, request=generate_requests())
    # Not vacuous: the generator keeps about half the requests within limits, and every
    # one of those was answered in full (a refusal of one fails the case above).
    assert verdicts.accepted >= EXAMPLES // 4, (verdicts.accepted, verdicts.refused)
    assert len(verdicts.refused) >= 6, verdicts.refused  # the refusals span many reasons
    assert server.servicer.in_flight == 0


def test_fuzz_generate_groups(served: tuple[RolloutServer, Any]) -> None:
    """Batches of 1-4 fuzzed groups: answered in full, each group as GenerateGroup would
    answer it alone, when none has a problem; else refused naming a problem of one."""
    server, channel = served
    verdicts = Verdicts(server, channel)
    decode = rollout_pb2.GenerateGroupsResponse.FromString
    method = channel.unary_unary(f"{SERVICE}/GenerateGroups", response_deserializer=decode)

    def check(groups: list[rollout_pb2.GenerateRequest]) -> None:
        version = server.engine.version
        expected = [p for g in groups for p in problems(g, verdicts.tokenizer, version)]
        batch = rollout_pb2.GenerateGroupsRequest(groups=groups)
        try:
            answer = method(batch.SerializeToString(), timeout=60)
        except grpc.RpcError as exc:
            verdicts.refusal(exc, expected)
            return
        assert not expected, f"answered despite {expected}"
        verdicts.accepted += 1
        assert [g.request_id for g in answer.groups] == [g.request_id for g in groups]
        for request, group in zip(groups, answer.groups, strict=True):
            assert list(group.prompt_token_ids) == prompt_ids(request)
            assert len(group.completions) == request.n
            for completion in group.completions:
                check_completion(completion, request, verdicts.stops)

    fuzz(check, groups=st.lists(generate_requests(), min_size=1, max_size=4))
    assert verdicts.accepted >= EXAMPLES // 10, (verdicts.accepted, verdicts.refused)
    assert len(verdicts.refused) >= 4, verdicts.refused
    assert server.servicer.in_flight == 0


# -- structure: another RPC's message, fields far over the limits ---------------------------


# Sizes far past every limit (prompt 10 tokens, request 64 KiB on the fuzz server).
HUGE = st.sampled_from([11, 1000, 20_000, 100_000])


@st.composite
def oversized(draw: st.DrawFn) -> rollout_pb2.GenerateRequest:
    """A plausible request with one repeated field or string far over the limits."""
    request = draw(generate_requests())
    size, value = draw(HUGE), draw(st.one_of(st.integers(0, 13), INT32))
    field = draw(
        st.sampled_from(
            ["prompt_token_ids", "stop_token_ids", "request_id", "tokenizer_fingerprint"]
        )
    )
    if field == "prompt_token_ids":
        del request.prompt_token_ids[:]
        request.prompt_token_ids.extend([value] * size)
    elif field == "stop_token_ids":
        request.sampling.stop_token_ids.extend([value] * size)
    else:
        setattr(request, field, "7" * size)
    return request


STRUCTURES = st.one_of(STRUCTURE_BYTES, oversized().map(lambda m: m.SerializeToString()))


# -- raw bytes to every method ---------------------------------------------------------------

TINY = rollout_pb2.GenerateRequest(
    prompt_token_ids=[1, 2], n=1, sampling=rollout_pb2.SamplingParams(max_tokens=1)
)


def raw_status(server: RolloutServer, channel: Any, data: bytes) -> None:
    """GetStatus on raw bytes: the server's state iff they decode, else INVALID_ARGUMENT."""
    try:
        reply = raw_call(channel, f"{SERVICE}/GetStatus", data, timeout=60)
    except grpc.RpcError as exc:
        assert_clear_refusal(exc, INVALID)
        assert not decodes(rollout_pb2.GetStatusRequest, data) and "cannot decode" in exc.details()
        return
    assert decodes(rollout_pb2.GetStatusRequest, data)
    status = rollout_pb2.RolloutStatus.FromString(reply)
    assert status.ready and status.requests_in_flight == 0, status
    assert (status.version, status.engine) == (server.engine.version, "torch"), status


# Messages to spoil: a request, or for the empty requests the bytes of any other message
# (unknown fields, which they must ignore).
RAW_MESSAGES = {
    "GenerateGroup": wire_bytes(generate_requests()),
    "GetStatus": wire_bytes(st.one_of(generate_requests(), st.just(TINY))),
    "GenerateGroup/structure": STRUCTURES,
    "GetStatus/structure": STRUCTURES,
}


@pytest.mark.parametrize("method", RAW_MESSAGES)
def test_fuzz_raw_bytes(served: tuple[RolloutServer, Any], method: str) -> None:
    """Bytes another language's client could send, or well-formed messages of the wrong
    structure: they decode and get the verdict the decoded request deserves, or they
    don't and get INVALID_ARGUMENT."""
    server, channel = served
    verdicts = Verdicts(server, channel)

    def check(data: bytes) -> None:
        if method.startswith("GetStatus"):
            raw_status(server, channel, data)
        elif decodes(rollout_pb2.GenerateRequest, data):
            verdicts.check(rollout_pb2.GenerateRequest.FromString(data), data)
        else:
            with pytest.raises(grpc.RpcError) as caught:
                call(channel, data)
            assert_clear_refusal(caught.value, INVALID)
            assert "cannot decode" in caught.value.details()
            verdicts.refused["cannot decode"] = verdicts.refused.get("cannot decode", 0) + 1

    fuzz(check, data=RAW_MESSAGES[method])
    assert server.servicer.in_flight == 0
    if method == "GenerateGroup/structure":  # not vacuous: the limits were reached
        assert {"rollout.max_request_bytes", "shared.max_prompt_length"} <= set(verdicts.refused)
        assert verdicts.accepted > 0 and verdicts.refused["cannot decode"] > 0, verdicts.refused


def test_a_refusal_of_a_huge_request_keeps_its_words(served: tuple[RolloutServer, Any]) -> None:
    """Found by test_fuzz_raw_bytes: 20,000 stop ids and a bad top_p. The refusal quoted
    the whole request (60 kB of details), past gRPC's 16 KiB header limit, so the client
    got RESOURCE_EXHAUSTED "Stream removed" instead of INVALID_ARGUMENT and the reason."""
    _, channel = served
    sampling = rollout_pb2.SamplingParams(top_p=2.0, stop_token_ids=[0] * 20_000)
    request = rollout_pb2.GenerateRequest(
        request_id="huge", prompt_token_ids=[1, 2], n=1, sampling=sampling
    )
    with pytest.raises(grpc.RpcError) as caught:
        call(channel, request.SerializeToString())
    assert_clear_refusal(caught.value, grpc.StatusCode.INVALID_ARGUMENT)
    assert "top_p" in caught.value.details() and len(caught.value.details()) < 200


def test_refusal_details_are_bounded() -> None:
    """Whatever a message quotes, the details stay below gRPC's header limit."""
    assert bounded_details("short") == "short"
    long = bounded_details("x" * 60_000)
    assert len(long) < MAX_DETAILS_CHARS + 50 and long.endswith("(58000 more characters cut)")
