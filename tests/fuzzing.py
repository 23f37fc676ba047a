"""Shared pieces of the property-based (hypothesis) fuzz tests.

Every fuzz test runs a fixed number of generated cases (`cases(n)`) against a server
started once per module, counts the cases it really ran and asserts the count, so
"1000 inputs per endpoint" is a checked fact rather than a setting.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import grpc
import httpx
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st

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
