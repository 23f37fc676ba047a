"""Fuzzing the reward service: generated JSON and protobuf against one real server.

1000 generated requests per HTTP route and for gRPC Score (decoded messages and raw
bytes), and 1000 of the wrong structure for POST /v1/score and Score: JSON nested up to
100000 deep, arrays and objects of up to 20000 entries, objects where lists are expected
and the reverse, mixed types, duplicate keys, numbers of thousands of digits, NaN,
non-UTF-8 bytes; another RPC's message, repeated items far over the limit, unknown
groups nested past protobuf's limit. None may crash the server or answer 5xx /
INTERNAL; a refusal is a 4xx or INVALID_ARGUMENT with a one-line message, an acceptance
answers every item in order.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest
from fuzzing import (
    PROTO_TEXTS,
    STRUCTURE_BYTES,
    TEXT_LIMIT,
    TEXTS,
    Counter,
    assert_clear_refusal,
    decodes,
    fuzz,
    http_client,
    raw_call,
)
from hypothesis import strategies as st
from reward_fixtures import reward_server

from dapo.v1 import reward_pb2, reward_pb2_grpc
from reward.server import RewardServer

MAX_ITEMS = 4
VERIFIERS = ["dapo", "math_verify", "cascade", "first_integer"]
SCORE = "/dapo.v1.RewardService/Score"


@pytest.fixture(scope="module")
def server() -> Iterator[RewardServer]:
    with reward_server(
        MAX_ITEMS,
        timeout_s=5.0,
        max_response_chars=TEXT_LIMIT,
        max_ground_truth_chars=TEXT_LIMIT,
        default_verifier="dapo",  # cheap: 1000 requests must finish fast
        max_request_bytes=64 * 1024,
    ) as server:
        yield server


@pytest.fixture(scope="module")
def http(server: RewardServer) -> Iterator[httpx.Client]:
    with http_client(f"http://127.0.0.1:{server.http_port}") as client:
        yield client


@pytest.fixture(scope="module")
def channel(server: RewardServer) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        yield channel


# -- strategies -------------------------------------------------------------------------

JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), TEXTS)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXTS, inner, max_size=3),
    max_leaves=8,
)
OPTIONAL_FIELDS = {
    "id": st.one_of(TEXTS, JSON_SCALARS),
    "verifier": st.one_of(st.sampled_from(VERIFIERS), st.none(), JSON_SCALARS),
    "response_length": st.one_of(
        st.integers(-5, 200), st.integers(), st.none(), st.floats(), JSON_SCALARS
    ),
    "truncated": st.one_of(st.booleans(), JSON_SCALARS),
    "extra": JSON_VALUES,
}


@st.composite
def json_items(draw: st.DrawFn) -> dict[str, Any]:
    """Mostly well-typed items; any field may be missing, mistyped or unknown."""
    item: dict[str, Any] = {}
    for name in ("response", "ground_truth"):
        if draw(st.integers(0, 9)):  # 1 in 10 missing
            item[name] = draw(TEXTS) if draw(st.integers(0, 9)) else draw(JSON_VALUES)
    for name, strategy in OPTIONAL_FIELDS.items():
        if draw(st.booleans()) and (name != "extra" or draw(st.integers(0, 4)) == 0):
            item[name] = draw(strategy)
    return item


SCORE_BODIES = st.one_of(
    st.builds(
        lambda items: json.dumps({"items": items}).encode(),
        st.lists(json_items(), max_size=MAX_ITEMS + 1),
    ),
    st.builds(lambda value: json.dumps(value).encode(), JSON_VALUES),
    st.binary(max_size=64),
    st.builds(lambda t: t.encode("utf-8", "surrogatepass"), st.text(max_size=32)),
)


def expected_items(body: bytes) -> list[Any] | None:
    """The items list a well-formed body carries (None: the server must refuse)."""
    try:
        data = json.loads(body.decode("utf-8", "replace"))
    except (ValueError, RecursionError):
        return None
    return data.get("items") if isinstance(data, dict) else None


# -- HTTP -------------------------------------------------------------------------------


def check_score_reply(reply: httpx.Response, body: bytes) -> None:
    assert reply.status_code < 500, reply.text
    if reply.status_code != 200:
        assert 400 <= reply.status_code < 500
        detail = reply.json()["detail"]
        assert isinstance(detail, str) and detail.strip()
        assert "\n" not in detail
        return
    items = expected_items(body)
    assert isinstance(items, list) and len(items) <= MAX_ITEMS
    results = reply.json()["results"]
    assert len(results) == len(items)
    for result, item in zip(results, items, strict=True):
        assert result["id"] == item.get("id", "").encode("utf-8", "replace").decode()
        assert result["reward"] <= 1.0 and isinstance(result["correct"], bool)


def test_fuzz_http_score(http: httpx.Client) -> None:

    def check(body: bytes) -> None:
        reply = http.post("/v1/score", content=body, headers={"content-type": "application/json"})
        check_score_reply(reply, body)

    fuzz(check, body=SCORE_BODIES)


# Structure: JSON text built directly, so it can hold what json.dumps never writes
# (duplicate keys, NaN, 5000-digit numbers) and sizes hypothesis would not generate.
ITEM = '{"response": "Answer: 1", "ground_truth": "1"}'
SCALARS = ['"x"', "1", "-0.5", "true", "null", "1e400", "NaN", "-Infinity", "[]", "{}", ITEM]


def _nested(depth: int, kind: str, closed: bool) -> str:
    opening, closing = ("[", "]") if kind == "list" else ('{"a":', "}")
    return opening * depth + "1" + (closing * depth if closed else "")


WRONG_VALUES = st.one_of(
    st.builds(
        _nested,
        st.one_of(st.integers(1, 1200), st.sampled_from([5000, 100_000])),
        st.sampled_from(["list", "object"]),
        st.booleans(),
    ),
    st.builds(
        lambda elem, n: "[" + ",".join([elem] * n) + "]",
        st.sampled_from(SCALARS),
        st.sampled_from([0, 5, 1000, 20_000]),
    ),
    st.builds(
        lambda n: "{" + ",".join(f'"k{i}": 1' for i in range(n)) + "}",
        st.sampled_from([1, 5, 1000, 20_000]),
    ),
    st.builds(lambda n: "9" * n, st.sampled_from([10, 4300, 4301, 6000])),
    st.lists(JSON_VALUES, max_size=4).map(json.dumps),
    st.sampled_from(SCALARS),
)
PLACES = [  # where the value goes: V
    "V",  # the whole body
    '{"items": V}',
    '{"items": [V]}',
    '{"items": [V, ' + ITEM + "]}",
    '{"items": [{"response": V, "ground_truth": "1"}]}',
    '{"items": [{"response": "1", "ground_truth": "1", "response_length": V}]}',
    '{"items": [' + ITEM + '], "items": V}',  # duplicate keys: the last one wins
    '{"items": V, "items": [' + ITEM + "]}",
    '{"items": [{"response": "1", "response": V, "ground_truth": "1"}]}',
]


@st.composite
def structured_bodies(draw: st.DrawFn) -> bytes:
    """A value of the wrong structure somewhere in a body, perhaps not UTF-8 at all."""
    text = draw(st.sampled_from(PLACES)).replace("V", draw(WRONG_VALUES))
    how = draw(st.sampled_from(["utf-8", "utf-8", "utf-8", "utf-16", "bom", "junk"]))
    if how == "utf-16":
        return text.encode("utf-16")
    if how == "bom":
        return b"\xef\xbb\xbf" + text.encode()
    body = text.encode()
    if how == "junk":  # bytes that are not UTF-8, somewhere
        at = draw(st.integers(0, len(body)))
        body = body[:at] + draw(st.binary(min_size=1, max_size=4).map(_high)) + body[at:]
    return body


def _high(data: bytes) -> bytes:
    return bytes(b | 0x80 for b in data)


def test_fuzz_http_score_structure(http: httpx.Client) -> None:
    codes = {}

    def check(body: bytes) -> None:
        reply = http.post("/v1/score", content=body, headers={"content-type": "application/json"})
        check_score_reply(reply, body)
        codes[reply.status_code] = codes.get(reply.status_code, 0) + 1

    fuzz(check, body=structured_bodies())
    assert set(codes) >= {200, 413, 422}, codes  # not vacuous: every outcome was reached


ROUTES = ["/healthz", "/readyz", "/metrics", "/status", "/openapi.json"]
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]
QUERY = st.dictionaries(st.text(min_size=1, max_size=8), st.text(max_size=8), max_size=3)


@pytest.mark.parametrize("route", ROUTES)
def test_fuzz_http_other_routes(http: httpx.Client, route: str) -> None:

    def check(method: str, params: dict[str, str], body: bytes) -> None:
        reply = http.request(method, route, params=params, content=body)
        assert reply.status_code < 500, reply.text
        if method == "GET":
            assert reply.status_code == 200
        elif method != "HEAD":  # HEAD: 405 on API routes, 200 on /openapi.json
            assert reply.status_code == 405
            assert "not allowed" in reply.json()["detail"].lower()

    fuzz(check, method=st.sampled_from(METHODS), params=QUERY, body=st.binary(max_size=32))


# -- gRPC -------------------------------------------------------------------------------

PROTO_ITEMS = st.builds(
    reward_pb2.ScoreItem,
    id=PROTO_TEXTS,
    response=PROTO_TEXTS,
    ground_truth=PROTO_TEXTS,
    verifier=st.integers(-2, 7),
    response_length=st.one_of(st.integers(0, 200), st.integers(0, 2**32 - 1)),
    truncated=st.booleans(),
)


def test_fuzz_grpc_score(channel: grpc.Channel) -> None:
    stub = reward_pb2_grpc.RewardServiceStub(channel)

    def check(items: list[reward_pb2.ScoreItem]) -> None:
        try:
            reply = stub.Score(reward_pb2.ScoreRequest(items=items), timeout=60)
        except grpc.RpcError as exc:
            assert_clear_refusal(exc)
            assert (
                len(items) > MAX_ITEMS
                or any(i.verifier not in range(5) for i in items)
                or any(max(len(i.response), len(i.ground_truth)) > TEXT_LIMIT for i in items)
            )
            return
        assert len(items) <= MAX_ITEMS
        assert [r.id for r in reply.results] == [i.id for i in items]

    fuzz(check, items=st.lists(PROTO_ITEMS, max_size=MAX_ITEMS + 1))


def test_fuzz_grpc_score_raw_bytes(channel: grpc.Channel) -> None:

    def check(data: bytes) -> None:
        try:
            reply = reward_pb2.ScoreResponse.FromString(raw_call(channel, SCORE, data))
        except grpc.RpcError as exc:
            assert_clear_refusal(exc)
            return
        request = reward_pb2.ScoreRequest.FromString(data)  # the server decoded it too
        assert len(reply.results) == len(request.items)

    fuzz(check, data=st.binary(max_size=96))


def oversized_score_requests() -> st.SearchStrategy[bytes]:
    """ScoreRequests with items or texts far over the limits."""
    sizes = st.sampled_from([MAX_ITEMS + 1, 1000, 20_000])
    many = sizes.map(lambda n: reward_pb2.ScoreRequest(items=[reward_pb2.ScoreItem()] * n))
    long_text = st.sampled_from([TEXT_LIMIT + 1, 10_000, 1_000_000]).map(
        lambda n: reward_pb2.ScoreRequest(items=[reward_pb2.ScoreItem(response="7" * n)])
    )
    return st.one_of(many, long_text).map(lambda m: m.SerializeToString())


def test_fuzz_grpc_score_structure(channel: grpc.Channel) -> None:
    """Another RPC's message, repeated items or texts far over the limits, unknown groups
    nested past protobuf's recursion limit: answered as the decoded request deserves, or
    refused with INVALID_ARGUMENT naming the problem."""
    refused = Counter()

    def check(data: bytes) -> None:
        try:
            reply = reward_pb2.ScoreResponse.FromString(raw_call(channel, SCORE, data))
        except grpc.RpcError as exc:
            refused()
            assert_clear_refusal(exc)
            if not decodes(reward_pb2.ScoreRequest, data):
                assert "cannot decode" in exc.details()
                return
            items = reward_pb2.ScoreRequest.FromString(data).items
            assert (
                len(items) > MAX_ITEMS
                or any(i.verifier not in range(5) or len(i.response) > TEXT_LIMIT for i in items)
                or any(len(i.ground_truth) > TEXT_LIMIT for i in items)
            ), exc.details()
            return
        request = reward_pb2.ScoreRequest.FromString(data)  # the server decoded it too
        assert len(request.items) <= MAX_ITEMS
        assert [r.id for r in reply.results] == [i.id for i in request.items]

    seen = fuzz(check, data=st.one_of(STRUCTURE_BYTES, oversized_score_requests()))
    assert 0 < refused.n < seen, refused.n
