"""Errors that the CLI turns into one clear line and a non-zero exit (no traceback wall)."""

from __future__ import annotations

from typing import Any


class DapoError(Exception):
    """A user-facing failure: bad config, missing file, busy port, unreachable Redis."""


class PortInUseError(DapoError):
    """A requested port is already taken."""


# gRPC trailing metadata key under which a server that refuses a request names the limit
# or check it failed (e.g. `shared.max_prompt_length`): the caller tells a request that can
# never succeed from one worth another try without parsing the message.
REFUSAL_KEY = "dapo-refusal"


def one_line(text: str) -> str:
    """`text` with control characters escaped, so a message stays on one line."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def describe_validation(errors: list[Any], default: str, limit: int | None = 10) -> str:
    """pydantic's errors as one line: `field.path: problem; ...`, names escaped."""
    parts = [
        f"{one_line('.'.join(str(p) for p in err['loc'])) or default}: {one_line(err['msg'])}"
        for err in errors[:limit]
    ]
    return "; ".join(parts)
