"""argparse types for numbers and URLs, shared by every `dapo` command and role: a bad
value is refused at parse time, so it is one line (`dapo CMD: error: argument --flag:
...`) and exit 2 before any work starts. Upper bounds catch typos, not plans.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from urllib.parse import urlsplit

from services.common.errors import one_line

# Upper bounds that no real invocation reaches: a huge value is a typo, not a plan.
MAX_COUNT = 10**9  # steps, intervals
MAX_PROCESSES = 1024  # rollout servers, learner ranks
MAX_SEEDS = 1000
MAX_SECONDS = 10**7  # about 4 months
REDIS_SCHEMES = ("redis", "rediss", "unix")


def bounded_int(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an integer in [low, high]."""

    def parse(text: str) -> int:
        value = int(text)  # a ValueError reads "invalid int value: 'x'" (argparse)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be in [{low}, {high}], got {value}")
        return value

    parse.__name__ = "int"  # argparse names the type in its own messages
    return parse


def seconds(*, allow_zero: bool) -> Callable[[str], float]:
    """An argparse type: a finite number of seconds, > 0 (or >= 0 with `allow_zero`)."""

    def parse(text: str) -> float:
        value = float(text)  # a ValueError reads "invalid float value: 'x'" (argparse)
        low_ok = value >= 0 if allow_zero else value > 0
        if not (math.isfinite(value) and low_ok and value <= MAX_SECONDS):
            bound = ">= 0" if allow_zero else "> 0"
            raise argparse.ArgumentTypeError(
                f"must be {bound} and <= {MAX_SECONDS} seconds, got {text}"
            )
        return value

    parse.__name__ = "float"
    return parse


def load_average(text: str) -> float:
    """An argparse type: a load-average bound, a finite number > 0."""
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a load average > 0, got {text}")
    return value


load_average.__name__ = "float"

positive = bounded_int(1, MAX_COUNT)
non_negative = bounded_int(0, MAX_COUNT)
processes = bounded_int(1, MAX_PROCESSES)
seed_count = bounded_int(1, MAX_SEEDS)
seed_value = bounded_int(0, 2**32 - 1)


def redis_url(text: str) -> str:
    """An argparse type: a URL redis-py can connect with (scheme, host or socket, port)."""
    problem = redis_url_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(f"{problem}; e.g. redis://127.0.0.1:6379/0")
    return text


def redis_url_problem(text: str) -> str | None:
    """Why `text` is not a usable Redis URL (None: it is)."""
    try:
        url = urlsplit(text)
        port = url.port
    except ValueError as exc:
        return f"not a Redis URL: {one_line(text)!r} ({exc})"
    if url.scheme not in REDIS_SCHEMES:
        schemes = ", ".join(f"{s}://" for s in REDIS_SCHEMES)
        return f"not a Redis URL: {one_line(text)!r} (the scheme must be one of {schemes})"
    if url.scheme == "unix":
        return None if url.path else f"not a Redis URL: {one_line(text)!r} (no socket path)"
    if not url.hostname:
        return f"not a Redis URL: {one_line(text)!r} (no host)"
    if port == 0:
        return f"not a Redis URL: {one_line(text)!r} (port 0)"
    return None
