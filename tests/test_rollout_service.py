"""The rollout service over real gRPC and HTTP with the torch engine on the tiny model.

GenerateGroup answers n tagged samples, seeded and in order; each limit gives
INVALID_ARGUMENT naming it; concurrent calls share engine calls, and so do the groups of
one GenerateGroups call; a call past max_concurrent_requests is refused; the removed RPCs
answer UNIMPLEMENTED. Weights and
catch-up: tests/test_rollout_service_weights.py.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from rollout_fixtures import (
    MAX_N,
    MAX_PROMPT,
    MAX_RESPONSE,
    PROMPT,
    SEEDED,
    Served,
    make_config,
    metric,
    serve,
    wait_for,
)

from dapo.v1 import rollout_pb2
from rollout.torch_engine import TorchEngine
from services.common.adapters import sample_from_completion

# -- generation ------------------------------------------------------------------------


def test_generate_group_returns_n_tagged_samples_and_counts_them(tiny_model: Path) -> None:
    with serve(tiny_model, make_config()) as s:
        expected_prompt = s.engine.tokenizer.encode("1+2=", add_special_tokens=False)
        request = rollout_pb2.GenerateRequest(
            request_id="g1", prompt_token_ids=expected_prompt, n=3
        )
        group = s.stub.GenerateGroup(request, timeout=60)
        assert group.request_id == "g1" and list(group.prompt_token_ids) == expected_prompt
        assert len(group.completions) == 3
        tokens = 0
        for c in group.completions:
            out = sample_from_completion(c)
            assert 1 <= len(out.token_ids) == len(out.logprobs) <= MAX_RESPONSE
            assert c.policy_version == 0 and (out.logprobs <= 0).all()
            assert c.finish_reason in (
                rollout_pb2.FINISH_REASON_STOP,
                rollout_pb2.FINISH_REASON_LENGTH,
            )
            tokens += len(out.token_ids)
        assert metric(s, "dapo_rollout_tokens_generated_total") == tokens
        assert metric(s, "dapo_rollout_tokens_per_second") > 0
        assert metric(s, "dapo_rollout_requests_in_flight") == 0
        assert metric(s, "dapo_rollout_queue_depth") == 0
        assert s.fingerprint() == s.fingerprint()  # seeded: reproducible through the service


def _at_least(version: int, n: int = 2) -> rollout_pb2.GenerateRequest:
    return rollout_pb2.GenerateRequest(
        request_id="v", prompt_token_ids=PROMPT, n=n, sampling=SEEDED, min_version=version
    )


def test_the_server_reports_the_tokenizer_the_controller_loads(tiny_model: Path) -> None:
    """One model path, one fingerprint: what the controller renders with
    (services/common/tokenizer.py) is what the server checks requests against."""
    from services.common.tokenizer import load_tokenizer

    ours = load_tokenizer(tiny_model, chat=False).fingerprint
    with serve(tiny_model, make_config()) as s:
        status = s.stub.GetStatus(rollout_pb2.GetStatusRequest(), timeout=10)
        assert status.tokenizer_fingerprint == ours
        request = _request(fingerprint=ours)
        assert len(s.stub.GenerateGroup(request, timeout=60).completions) == 1


def test_generate_group_is_seeded_and_ordered(tiny_model: Path) -> None:
    with serve(tiny_model, make_config()) as s:
        request = _at_least(0, n=3)
        first, again = (s.stub.GenerateGroup(request, timeout=60) for _ in range(2))
        assert first.request_id == "v" and list(first.prompt_token_ids) == PROMPT
        assert len(first.completions) == 3 and first == again  # seeded: the same samples
        # The sampler's seed advances per sample: the n samples differ from one another.
        assert len({c.token_ids_i32 for c in first.completions} | {b""}) > 2
        assert s.server.servicer.in_flight == 0


# -- limits ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def limited(tiny_model: Path) -> Iterator[Served]:
    config = make_config()
    config.shared.rpc.max_message_bytes = 64 * 1024
    with serve(tiny_model, config) as s:
        yield s


def _request(n: int = 1, ids: tuple[int, ...] = (3, 4), fingerprint: str = "", **sampling: Any):
    return rollout_pb2.GenerateRequest(
        prompt_token_ids=list(ids),
        tokenizer_fingerprint=fingerprint,
        n=n,
        sampling=rollout_pb2.SamplingParams(**{"max_tokens": 2, **sampling}),
    )


INVALID = grpc.StatusCode.INVALID_ARGUMENT
LIMIT_CASES = {
    "n_zero": (_request(n=0), INVALID, "rollout.max_n=4"),
    "n_too_many": (_request(n=MAX_N + 1), INVALID, "rollout.max_n=4"),
    "prompt_ids_too_long": (
        _request(ids=(3,) * (MAX_PROMPT + 1)),
        INVALID,
        "shared.max_prompt_length=12",
    ),
    "max_tokens": (_request(max_tokens=MAX_RESPONSE + 1), INVALID, "shared.max_response_length=8"),
    "request_bytes": (_request(ids=(7,) * 3000), INVALID, "rollout.max_request_bytes=2048"),
    "token_outside_vocab": (_request(ids=(3, 999)), INVALID, "vocabulary"),
    "empty_prompt": (_request(ids=()), INVALID, "empty"),
    "top_p": (_request(top_p=1.5), INVALID, "top_p"),
    "temperature": (_request(temperature=-1.0), INVALID, "temperature"),
    "another_tokenizer": (
        _request(fingerprint="0123456789abcdef"),
        grpc.StatusCode.FAILED_PRECONDITION,
        "one model path must decide every role's tokenizer",
    ),
    "past_max_message_bytes": (
        _request(ids=(7,) * 70_000),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "larger than max",
    ),
}


@pytest.mark.parametrize("case", LIMIT_CASES)
def test_limit_violation_names_the_limit(limited: Served, case: str) -> None:
    request, code, needle = LIMIT_CASES[case]
    with pytest.raises(grpc.RpcError) as err:
        limited.stub.GenerateGroup(request, timeout=30)
    assert err.value.code() == code
    assert needle in (err.value.details() or "")


def test_server_keeps_serving_after_bad_requests(limited: Served) -> None:
    for request, _, _ in LIMIT_CASES.values():
        with pytest.raises(grpc.RpcError):
            limited.stub.GenerateGroup(request, timeout=30)
    assert len(limited.generate(n=MAX_N)) == MAX_N
    assert limited.readyz() == 200


# -- batching, concurrency, removed RPCs --------------------------------------------------------


class Recording:
    """An engine wrapper that records each engine call and can hold one after its first
    sample (until `gate` is set), keeping a call in flight."""

    def __init__(self, inner: TorchEngine) -> None:
        self.inner = inner
        self.calls: list[int] = []  # prompts per engine call
        self.gate: threading.Event | None = None
        self.gate_timed_out = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    @property
    def version(self) -> int:
        return self.inner.version

    def stream(self, prompts: Any, params: Any) -> Iterator[Any]:
        self.calls.append(len(prompts))
        return self._gated(self.inner.stream(prompts, params))

    def _gated(self, samples: Iterator[Any]) -> Iterator[Any]:
        for k, sample in enumerate(samples):
            yield sample
            if k == 0 and self.gate is not None and not self.gate.wait(10):
                self.gate_timed_out = True


def test_concurrent_calls_are_batched_and_each_gets_its_n(tiny_model: Path) -> None:
    with serve(tiny_model, make_config(), wrap=Recording) as s:
        batcher, results = s.server.servicer.batcher, {}

        def call(i: int, n: int) -> None:
            results[i] = s.generate(n=n, prompt=[3 + i, 4], temperature=1.0, max_tokens=3)

        def accounted() -> int:  # requests in an engine call or waiting for one
            return sum(s.engine.calls) + batcher.pending()

        s.engine.inner.pause()  # calls pile up behind the first one
        threads = [threading.Thread(target=call, args=(i, 3)) for i in range(5)]
        threads.append(threading.Thread(target=call, args=(5, 2)))  # other params: own call
        for count, t in enumerate(threads, start=1):
            t.start()
            wait_for(lambda count=count: accounted() == count)
        s.engine.inner.resume()
        for t in threads:
            t.join(timeout=60)
        assert {i: len(r) for i, r in results.items()} == {0: 3, 1: 3, 2: 3, 3: 3, 4: 3, 5: 2}
        assert sum(s.engine.calls) == 6 and len(s.engine.calls) <= 3 and max(s.engine.calls) >= 4


def test_call_past_max_concurrent_requests_is_refused(tiny_model: Path) -> None:
    with serve(tiny_model, make_config(max_concurrent_requests=1), wrap=Recording) as s:
        s.engine.gate = threading.Event()
        held = s.stub.GenerateGroup.future(_request(n=2), timeout=60)
        wait_for(lambda: s.server.servicer.in_flight == 1)  # one call in flight: the limit
        with pytest.raises(grpc.RpcError) as busy:
            s.generate()
        assert busy.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "rollout.max_concurrent_requests" in (busy.value.details() or "")
        status = s.stub.GetStatus(rollout_pb2.GetStatusRequest(), timeout=5)
        assert status.requests_in_flight == 1 and status.ready and status.version == 0
        s.engine.gate.set()
        assert len(held.result().completions) == 2 and not s.engine.gate_timed_out
        status = s.stub.GetStatus(rollout_pb2.GetStatusRequest(), timeout=5)
        assert status.requests_in_flight == 0 and len(s.generate(n=2)) == 2


def _batch(*prompts: tuple[int, ...], n: int = 3) -> rollout_pb2.GenerateGroupsRequest:
    groups = []
    for i, ids in enumerate(prompts):
        request = _request(n=n, ids=ids, temperature=1.0)
        request.request_id = f"g{i}"
        groups.append(request)
    return rollout_pb2.GenerateGroupsRequest(groups=groups)


def test_generate_groups_answers_each_group_in_order_from_one_engine_call(
    tiny_model: Path,
) -> None:
    with serve(tiny_model, make_config(), wrap=Recording) as s:
        prompts = [(3, 4), (5, 6, 7), (8,), (4, 3)]
        answer = s.stub.GenerateGroups(_batch(*prompts), timeout=60)
        assert [g.request_id for g in answer.groups] == ["g0", "g1", "g2", "g3"]
        assert [tuple(g.prompt_token_ids) for g in answer.groups] == prompts
        assert [len(g.completions) for g in answer.groups] == [3] * 4
        for group in answer.groups:
            for c in group.completions:
                out = sample_from_completion(c)
                assert 1 <= len(out.token_ids) == len(out.logprobs) <= 2
        assert s.engine.calls == [4]  # all queued before any was read: one merged call
        assert metric(s, "dapo_rollout_requests_in_flight") == 0


def test_one_refused_group_refuses_the_batch_and_nothing_stays_in_flight(
    tiny_model: Path,
) -> None:
    with serve(tiny_model, make_config(max_concurrent_requests=1), wrap=Recording) as s:
        cases = [
            (_batch((3, 4), (3, 999)), "vocabulary"),  # the second group is bad
            (rollout_pb2.GenerateGroupsRequest(), "no groups"),
        ]
        for batch, needle in cases:
            with pytest.raises(grpc.RpcError) as err:
                s.stub.GenerateGroups(batch, timeout=30)
            assert err.value.code() == INVALID and needle in (err.value.details() or "")
            assert s.server.servicer.in_flight == 0
        assert s.engine.calls == []  # nothing of a refused batch reached the engine
        # A call holds one gRPC thread however many groups it asks: 3 groups pass a
        # limit of 1 call.
        answer = s.stub.GenerateGroups(_batch((3,), (4,), (5,)), timeout=60)
        assert [len(g.completions) for g in answer.groups] == [3, 3, 3]
        assert s.server.servicer.in_flight == 0


@pytest.mark.parametrize("method", ["Generate", "Pause", "Resume", "UpdateWeights"])
def test_removed_rpcs_are_unimplemented(limited: Served, method: str) -> None:
    call = limited.channel.unary_unary(f"/dapo.v1.RolloutService/{method}")
    with pytest.raises(grpc.RpcError) as err:
        call(b"", timeout=10)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


# -- draining (the scale-down under `dapo up`: tests/test_rollout_drain.py) ---------------


@pytest.mark.parametrize(("release", "held", "cut"), [(True, 1, 0), (False, 1, 1)])
def test_drain_refuses_new_calls_and_waits_for_the_held_one(
    tiny_model: Path, caplog: pytest.LogCaptureFixture, release: bool, held: int, cut: int
) -> None:
    """A call held when draining starts finishes (or, past the deadline, is counted cut
    off); calls after it get UNAVAILABLE, which the controller re-routes."""
    with serve(tiny_model, make_config(drain_timeout_s=1.5), wrap=Recording) as s:
        s.engine.gate = threading.Event()
        call = s.stub.GenerateGroup.future(_request(n=2), timeout=60)
        wait_for(lambda: s.server.servicer.in_flight == 1)
        drain = threading.Thread(target=s.server.drain)
        with caplog.at_level("INFO", logger="rollout.server"):
            drain.start()
            wait_for(s.server.servicer.draining.is_set)
            with pytest.raises(grpc.RpcError) as refused:
                s.generate()
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert drain.is_alive()  # still waiting for the held call
            if release:
                s.engine.gate.set()
            drain.join(timeout=10)
        s.engine.gate.set()
        assert len(call.result().completions) == 2 and not s.engine.gate_timed_out
        assert f"{held} calls held, {cut} cut off" in caplog.text
