"""The reward service end to end: real gRPC and HTTP servers on free ports, real workers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from reward_fixtures import reward_server

from dapo.v1 import reward_pb2, reward_pb2_grpc
from reward.metrics import sample_value
from reward.server import RewardServer

TIMEOUT_S = 2.0
MAX_ITEMS = 64
MAX_REQUEST_BYTES = 4 * 1024 * 1024
ONE_MB = 1_000_000
FIRST_INTEGER = reward_pb2.VERIFIER_FIRST_INTEGER


@pytest.fixture(scope="module")
def server() -> Iterator[RewardServer]:
    with reward_server(
        MAX_ITEMS,
        timeout_s=TIMEOUT_S,
        soft_timeout_s=0,  # only the hard kill: deterministic timings below
        max_request_bytes=MAX_REQUEST_BYTES,
    ) as server:
        yield server


@pytest.fixture(scope="module")
def channel(server: RewardServer) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        yield channel


@pytest.fixture(scope="module")
def http(server: RewardServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"http://127.0.0.1:{server.http_port}", timeout=30) as client:
        yield client


def item(response: str, gold: str, **kw: object) -> reward_pb2.ScoreItem:
    return reward_pb2.ScoreItem(response=response, ground_truth=gold, **kw)  # type: ignore[arg-type]


def score(channel: grpc.Channel, *items: reward_pb2.ScoreItem) -> reward_pb2.ScoreResponse:
    stub = reward_pb2_grpc.RewardServiceStub(channel)
    return stub.Score(reward_pb2.ScoreRequest(items=items), timeout=30)


def test_grpc_scores_and_shapes(channel: grpc.Channel) -> None:
    results = score(
        channel,
        item("Answer: 7", "7", id="short", response_length=50),
        item("Answer: 0.5", "\\frac{1}{2}", id="soft", response_length=90),
        item("Answer: 8", "7", id="long", response_length=120),
        item("9+9+", "9", id="toy", verifier=reward_pb2.VERIFIER_FIRST_INTEGER, truncated=True),
    ).results
    assert [r.id for r in results] == ["short", "soft", "long", "toy"]
    assert [r.correct for r in results] == [True, True, False, True]
    assert [r.reward for r in results] == pytest.approx([1.0, 0.5, -2.0, 1.0])
    assert [r.overlong_penalty for r in results] == pytest.approx([0.0, -0.5, -1.0, 0.0])
    assert [r.truncated for r in results] == [False, False, True, True]
    assert results[0].verifier == reward_pb2.VERIFIER_DAPO
    assert results[1].verifier == reward_pb2.VERIFIER_MATH_VERIFY
    assert results[3].verifier == reward_pb2.VERIFIER_FIRST_INTEGER
    assert (results[1].pred, results[3].pred) == ("0.5", "9")


def test_http_scores(http: httpx.Client) -> None:
    body = {
        "items": [
            {"id": "a", "response": "Answer: \\frac{1}{2}", "ground_truth": "0.5"},
            {"response": "Answer: 3", "ground_truth": "4", "verifier": "dapo"},
            {"response": "Answer: 7", "ground_truth": "7", "response_length": 100},
        ]
    }
    reply = http.post("/v1/score", json=body)
    assert reply.status_code == 200, reply.text
    results = reply.json()["results"]
    assert [r["correct"] for r in results] == [True, False, True]
    assert [r["reward"] for r in results] == pytest.approx([1.0, -1.0, 0.0])
    assert results[0]["id"] == "a" and results[1]["verifier"] == "dapo"
    assert set(results[0]) == {
        "id",
        "reward",
        "correct",
        "pred",
        "verifier",
        "error",
        "overlong_penalty",
        "truncated",
    }


def test_http_integer_ground_truth_is_its_string(http: httpx.Client) -> None:
    """AIME answers arrive as JSON numbers; the API scores them as their decimal text."""
    items = [("Answer: 204", 204), ("Answer: 7", 8)]
    body = {"items": [{"response": r, "ground_truth": g, "verifier": "dapo"} for r, g in items]}
    reply = http.post("/v1/score", json=body)
    assert reply.status_code == 200, reply.text
    assert [r["correct"] for r in reply.json()["results"]] == [True, False]


# -- limits and bad input --------------------------------------------------------------


def grpc_error(channel: grpc.Channel, *items: reward_pb2.ScoreItem) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        score(channel, *items)
    return info.value


def test_grpc_limits_are_invalid_argument(channel: grpc.Channel) -> None:
    cases = {
        "max_items": [item("Answer: 1", "1")] * (MAX_ITEMS + 1),
        "max_response_chars": [item("x" * (ONE_MB + 1), "1")],
        "max_ground_truth_chars": [item("Answer: 1", "1" * 10_001)],
    }
    for limit, items in cases.items():
        before = sample_value("dapo_reward_rejected_requests_total", {"limit": limit})
        error = grpc_error(channel, *items)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        field = "shared.rpc.max_score_items" if limit == "max_items" else f"reward.{limit}"
        assert f"{field}=" in error.details()
        after = sample_value("dapo_reward_rejected_requests_total", {"limit": limit})
        assert after == before + 1


def test_grpc_undecodable_request_is_invalid_argument(channel: grpc.Channel) -> None:
    bad_item = b"\x12\x02\xff\xfe"  # field 2 (response) holding invalid UTF-8
    raw = channel.unary_unary(
        "/dapo.v1.RewardService/Score",
        request_serializer=None,
        response_deserializer=reward_pb2.ScoreResponse.FromString,
    )
    with pytest.raises(grpc.RpcError) as info:
        raw(b"\x0a" + bytes([len(bad_item)]) + bad_item, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "cannot decode ScoreRequest" in info.value.details()
    error = grpc_error(channel, item("Answer: 1", "1", verifier=99))  # type: ignore[arg-type]
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "99" in error.details()


def test_http_limits(http: httpx.Client) -> None:
    many = {"items": [{"response": "1", "ground_truth": "1"}] * (MAX_ITEMS + 1)}
    reply = http.post("/v1/score", json=many)
    assert reply.status_code == 422 and reply.json()["limit"] == "max_items"
    long = {"items": [{"response": "x" * (ONE_MB + 1), "ground_truth": "1"}]}
    reply = http.post("/v1/score", json=long)
    assert reply.status_code == 422 and "reward.max_response_chars=" in reply.json()["detail"]
    huge = b'{"items": [{"response": "' + b"x" * MAX_REQUEST_BYTES + b'", "ground_truth": "1"}]}'
    reply = http.post("/v1/score", content=huge)
    assert reply.status_code == 413 and reply.json()["limit"] == "max_request_bytes"
    chunked = http.post("/v1/score", content=iter([huge[:1000], huge[1000:]]))  # no length
    assert chunked.status_code == 413


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b"not json", "not JSON"),
        (b'{"items": [{"response": "1"}]}', "items.0.ground_truth"),
        (b'{"items": [{"response": "1", "ground_truth": "1", "reward": 2}]}', "items.0.reward"),
        (b'{"items": [{"response": "1", "ground_truth": true}]}', "items.0.ground_truth"),
        (b'{"items": [{"response": "1", "ground_truth": 1.5}]}', "items.0.ground_truth"),
        (b'{"items": [{"response": "1", "ground_truth": "1", "verifier": "x"}]}', "verifier"),
        (b'{"items": [{"response": "1", "ground_truth": "1", "response_length": -1}]}', "length"),
    ],
)
def test_http_bad_requests_are_422_naming_the_field(
    http: httpx.Client, body: bytes, needle: str
) -> None:
    reply = http.post("/v1/score", content=body)
    assert reply.status_code == 422 and needle in reply.json()["detail"], reply.text


# -- adversarial batches ---------------------------------------------------------------


def normal_items(n: int) -> list[reward_pb2.ScoreItem]:
    """Items with known verdicts: even ones need math-verify (\\frac{2k}{2}), odd are wrong."""
    return [
        item(f"So\nAnswer: \\frac{{{2 * k}}}{{2}}" if k % 2 == 0 else f"Answer: {k + 1}", str(k))
        for k in range(n)
    ]


def test_adversarial_grpc_batch_is_bounded_and_harmless(
    server: RewardServer, channel: grpc.Channel, http: httpx.Client
) -> None:
    restarts_before = server.scorer.pool.restarts
    timeouts_before = sample_value("dapo_reward_timeouts_total")
    adversarial = {
        "tower": item("$9^{9^{9^{9^9}}}$", "5", verifier=reward_pb2.VERIFIER_MATH_VERIFY),
        "big_power": item("Answer: 9^{9^9}", "5"),  # a long C-level pow holding the GIL
        "1mb_answer": item("x" * (ONE_MB - 10) + "\nAnswer: 5", "5"),
        "1mb_toy": item("7" + "+8" * (ONE_MB // 2 - 1), "7", verifier=FIRST_INTEGER),
        "1mb_integer": item("7" * ONE_MB, "7", verifier=FIRST_INTEGER),
        "empty_response": item("", "5"),
        "empty_gold": item("Answer: 5", ""),
        "nested_boxed": item("Answer: \\boxed{\\boxed{\\boxed{7}}}", "7"),
        "unbalanced_boxed": item("\\boxed{" * 2000 + "}" * 1000, "7"),
    }
    normals = normal_items(12)
    start = time.monotonic()
    results = score(channel, *normals[:6], *adversarial.values(), *normals[6:]).results
    elapsed = time.monotonic() - start
    assert elapsed < TIMEOUT_S + 2.5, f"batch took {elapsed:.1f}s"
    normal_results = [*results[:6], *results[6 + len(adversarial) :]]
    assert [r.correct for r in normal_results] == [k % 2 == 0 for k in range(12)]
    odd = dict(zip(adversarial, results[6 : 6 + len(adversarial)], strict=True))
    for stuck in ("tower", "big_power"):
        assert "timeout_s=2" in odd[stuck].error and odd[stuck].reward == -1.0
    assert all(odd[k].correct for k in ("1mb_answer", "1mb_toy", "nested_boxed"))
    wrong = ("1mb_integer", "empty_response", "empty_gold", "unbalanced_boxed")
    assert not any(odd[k].correct for k in wrong)
    assert len(odd["1mb_integer"].pred) <= 1000  # not echoed back in full
    assert server.scorer.pool.restarts == restarts_before + 2
    assert sample_value("dapo_reward_timeouts_total") == timeouts_before + 2
    assert_healthy_afterwards(server, channel, http)


def test_adversarial_http_batch_with_broken_text(server: RewardServer, http: httpx.Client) -> None:
    body = (
        b'{"items": ['
        b'{"response": "Answer: 5\\ud800", "ground_truth": "5", "id": "\\udfff"},'
        b'{"response": "Answer: 6 \xff\xfe broken bytes", "ground_truth": "6"},'
        b'{"response": "", "ground_truth": ""},'
        b'{"response": "Answer: \\\\frac{1}{2}", "ground_truth": "0.5"}]}'
    )
    reply = http.post("/v1/score", content=body)
    assert reply.status_code == 200, reply.text
    results = reply.json()["results"]
    assert [r["correct"] for r in results] == [True, True, False, True]
    assert results[0]["id"] == "?" and all(r["reward"] in (1.0, -1.0) for r in results)


def assert_healthy_afterwards(server: RewardServer, channel: grpc.Channel, http: httpx.Client):
    assert server.scorer.pool.wait_ready(30)
    assert http.get("/healthz").status_code == 200
    assert http.get("/readyz").status_code == 200
    health = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service="dapo.v1.RewardService"), timeout=5
    )
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert score(channel, item("Answer: 2", "2")).results[0].correct


def test_metrics_and_status(server: RewardServer, channel: grpc.Channel, http: httpx.Client):
    labels = {"verifier": "dapo", "outcome": "correct"}
    before = sample_value("dapo_reward_items_total", labels)
    score(channel, *[item(f"Answer: {k}", str(k)) for k in range(5)])
    assert sample_value("dapo_reward_items_total", labels) == before + 5
    text = http.get("/metrics").text
    for name in (
        "dapo_reward_items_total",
        "dapo_reward_correct_rate",
        "dapo_reward_timeouts_total",
        "dapo_reward_errors_total",
        "dapo_reward_verify_seconds_bucket",
        "dapo_reward_request_seconds_bucket",
        "dapo_reward_pool_restarts_total",
    ):
        assert name in text, name
    status = http.get("/status").json()
    assert status["service"] == "reward" and status["workers"] == 2
    assert status["items_scored"] >= 5 and len(status["worker_pids"]) == 2


def test_concurrent_requests_share_the_pool(channel: grpc.Channel) -> None:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as executor:
        replies = list(executor.map(lambda _: score(channel, *normal_items(10)), range(4)))
    for reply in replies:
        assert [r.correct for r in reply.results] == [k % 2 == 0 for k in range(10)]


# -- the `dapo reward` entry point --------------------------------------------------------


def test_dapo_reward_command_serves_and_stops_on_sigterm() -> None:
    command = [
        sys.executable,
        "-c",
        "from services.tools.cli import main; raise SystemExit(main())",
        "reward",
        "--grpc-port",
        "0",
        "--http-port",
        "0",
        "--set",
        "reward.num_workers=1",
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        line = proc.stdout.readline().decode()  # type: ignore[union-attr]
        assert line.startswith("dapo reward ready"), line
        ports = dict(field.split("=") for field in line.split()[3:])
        url = f"http://127.0.0.1:{ports['http']}"
        body = {"items": [{"response": "Answer: 4", "ground_truth": "4"}]}
        reply = httpx.post(f"{url}/v1/score", json=body, timeout=30)
        assert json.loads(reply.text)["results"][0]["correct"] is True
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
