"""Shared pieces of the property-based (hypothesis) fuzz tests.

Every fuzz test runs a fixed number of generated cases (`cases(n)`) against a server
started once per module, counts the cases it really ran and asserts the count, so
"1000 inputs per endpoint" is a checked fact rather than a setting.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from dapo.v1 import learner_pb2, reward_pb2, rollout_pb2, tensor_pb2

EXAMPLES = 1000  # generated inputs per endpoint (issue #8)
# The rollout fuzz server's limits: tiny, so that a generated request costs milliseconds.
ROLLOUT_MAX_N, ROLLOUT_MAX_PROMPT, ROLLOUT_MAX_RESPONSE = 3, 10, 4
ROLLOUT_MAX_REQUEST_BYTES = 64 * 1024

# Cheap texts that have broken verifiers elsewhere: empty, nested boxes, odd LaTeX.
ODD_TEXTS = [
    "",
    " ",
    "Answer: 42",
    "Answer: \\boxed{\\boxed{5}}",
    "\\boxed{\\boxed{\\boxed{}}}",
    "\\boxed{",
    "}}}{{{",
    "$$",
    "\\frac{1}{0}",
    "1/0",
    "Answer:",
    "Answer: \n\n",
    "\x00",
    "\ufeff7",
    "٣",
    "1,000.5",
]
# Short strings mostly: the pool verifies every item, so long inputs make slow cases.
# Just past the fuzz servers' text limits (TEXT_LIMIT), to hit the refusals cheaply.
TEXT_LIMIT = 40
LONG_TEXTS = st.integers(TEXT_LIMIT - 2, TEXT_LIMIT + 20).map(lambda n: "7" * n)
TEXTS = st.one_of(st.text(max_size=12), st.sampled_from(ODD_TEXTS), LONG_TEXTS)
PROTO_TEXTS = st.one_of(
    st.text(st.characters(exclude_categories=["Cs"]), max_size=12),
    st.sampled_from(ODD_TEXTS),
    LONG_TEXTS,
)


def cases(n: int) -> settings:
    """Exactly `n` generated examples, no deadline, no example database, no shrink budget cap."""
    return settings(
        max_examples=n,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.generate, Phase.shrink],
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


class Counter:
    """How many generated cases a property really ran."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self) -> None:
        self.n += 1


def fuzz(check: Callable[..., None], **strategies: st.SearchStrategy[Any]) -> int:
    """Run `check` on `EXAMPLES` generated cases (its keyword arguments drawn from
    `strategies`; see `cases`), failing unless it really ran that many; how many it ran."""
    seen = Counter()

    @cases(EXAMPLES)
    @given(**strategies)
    def run(**case: Any) -> None:
        seen()
        check(**case)

    run()
    assert seen.n >= EXAMPLES
    return seen.n


def http_client(base_url: str) -> httpx.Client:
    """An HTTP client with TCP_NODELAY: httpx writes headers and body separately, and
    without it Nagle plus delayed ACKs add ~40 ms to every POST (1000 cases = 40 s)."""
    nodelay = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]
    transport = httpx.HTTPTransport(socket_options=nodelay)
    return httpx.Client(base_url=base_url, timeout=60, transport=transport)


def raw_call(channel: grpc.Channel, method: str, data: bytes, timeout: float = 30) -> bytes:
    """Send undecoded bytes to a unary method (what another language's client could send)."""
    call: Callable[..., Any] = channel.unary_unary(
        method, request_serializer=None, response_deserializer=None
    )
    return call(data, timeout=timeout)


def assert_clear_refusal(exc: grpc.RpcError, *allowed: grpc.StatusCode) -> None:
    """A refusal is one of the expected codes and says why in words."""
    codes = allowed or (grpc.StatusCode.INVALID_ARGUMENT,)
    assert exc.code() in codes, f"{exc.code()}: {exc.details()}"
    assert exc.details() and exc.details().strip(), f"{exc.code()} without a message"


@st.composite
def _mutate(draw: st.DrawFn, data: bytes) -> bytes:
    at = draw(st.integers(0, len(data)))
    how = draw(st.sampled_from(["cut", "flip", "junk"]))
    if how == "cut":
        return data[:at]
    if how == "flip" and data:
        at %= len(data)
        return data[:at] + bytes([data[at] ^ draw(st.integers(1, 255))]) + data[at + 1 :]
    return data[:at] + draw(st.binary(min_size=1, max_size=6)) + data[at:]


def wire_bytes(messages: st.SearchStrategy[Any]) -> st.SearchStrategy[bytes]:
    """Raw bytes: random, or a generated message serialized and then cut, with one byte
    changed or with junk inserted (near-valid input reaches deeper than noise)."""
    serialized = messages.map(lambda m: m.SerializeToString())
    return st.one_of(st.binary(max_size=48), serialized.flatmap(_mutate))


def decodes(message: Any, data: bytes) -> bool:
    """Whether protobuf can parse `data` as `message` (what the server must do first)."""
    try:
        message.FromString(data)
    except Exception:  # DecodeError, or the C runtime's own error types
        return False
    return True


def serve_rollout(model: Path) -> Iterator[tuple[Any, grpc.Channel]]:
    """(server, channel): a real rollout server (torch engine) with tiny limits on free
    ports, for a module fixture to `yield from`. No weight sync: `min_version` past the
    served version is refused at once (UNAVAILABLE), not after a wait."""
    from rollout.server import RolloutServer
    from rollout.torch_engine import TorchEngine
    from services.common.grpc_server import insecure_channel
    from services.tools.config import DapoConfig

    config = DapoConfig.model_validate(
        {
            "shared": {
                "max_prompt_length": ROLLOUT_MAX_PROMPT,
                "max_response_length": ROLLOUT_MAX_RESPONSE,
                "overlong_buffer_length": 0,
            },
            "rollout": {
                "server": {"grpc_port": 0, "http_port": 0},
                "max_n": ROLLOUT_MAX_N,
                "max_request_bytes": ROLLOUT_MAX_REQUEST_BYTES,
                "min_version_wait_s": 0,
            },
        }
    )
    engine = TorchEngine(model, device="cpu", max_batch_size=8)
    server = RolloutServer(config, None, engine).start()
    channel = insecure_channel(f"127.0.0.1:{server.grpc_port}")
    yield server, channel
    channel.close()
    server.stop()


# -- structure: well-formed bytes of the wrong shape ---------------------------------------

_INT32 = st.integers(-(2**31), 2**31 - 1)
_U32, _U64 = st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1)
_TEXT, _BYTES = st.text(max_size=8), st.binary(max_size=16)


def _up_to(n: int, message: Any, **fields: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Lists of at most `n` generated `message`s."""
    return st.lists(st.builds(message, **fields), max_size=n)


# A valid message of another RPC's type (or of this one's, for the other services).
FOREIGN_MESSAGES = st.one_of(
    st.builds(
        rollout_pb2.RolloutStatus, version=_U64, ready=st.booleans(), engine=_TEXT, model=_TEXT
    ),
    st.builds(
        rollout_pb2.GenerateGroupResponse,
        request_id=_TEXT,
        prompt_token_ids=st.lists(_INT32, max_size=8),
        completions=_up_to(3, rollout_pb2.Completion, token_ids_i32=_BYTES, text=_TEXT),
    ),
    st.builds(
        tensor_pb2.WeightBucket,
        version=_U64,
        index=_U32,
        last=st.booleans(),
        slices=_up_to(
            2,
            tensor_pb2.TensorSlice,
            name=_TEXT,
            shape=st.lists(st.integers(-5, 5), max_size=3),
            data=_BYTES,
        ),
    ),
    st.builds(learner_pb2.FetchWeightsRequest, version=_U64, bucket_bytes=_U32),
    st.builds(
        rollout_pb2.GenerateRequest,
        tokenizer_fingerprint=_TEXT,
        n=st.integers(0, 9),
        prompt_token_ids=st.lists(_INT32, max_size=8),
    ),
    st.builds(
        reward_pb2.ScoreRequest,
        items=_up_to(3, reward_pb2.ScoreItem, response=_TEXT, ground_truth=_TEXT),
    ),
)


def nested_groups(field: int = 15) -> st.SearchStrategy[bytes]:
    """An unknown field of nested groups (wire types 3/4), `depth` deep: protobuf parses
    unknown groups recursively and refuses past its recursion limit (100)."""
    start, end = bytes([field << 3 | 3]), bytes([field << 3 | 4])
    depths = st.one_of(st.integers(1, 120), st.sampled_from([1000, 100_000]))
    return depths.map(lambda depth: start * depth + end * depth)


def unknown_field(field: int = 15) -> st.SearchStrategy[bytes]:
    """One unknown length-delimited field of up to 1 MB (well-formed: ignored)."""
    sizes = st.sampled_from([0, 100, 70_000, 1_000_000])
    return sizes.map(lambda n: bytes([field << 3 | 2]) + _varint(n) + b"7" * n)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    return bytes([*out, value])


# Well-formed bytes of the wrong shape for any method: another RPC's message, unknown
# groups nested past protobuf's recursion limit, or one huge unknown field.
STRUCTURE_BYTES = st.one_of(
    FOREIGN_MESSAGES.map(lambda m: m.SerializeToString()), nested_groups(), unknown_field()
)
