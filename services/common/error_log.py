"""The latest error a service met, for its /status: when a run stops making progress,
`dapo up` reads it from every service and shows why (services/tools/liveness.py)."""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

from services.common.errors import one_line

MESSAGE_CHARS = 200


class ErrorLog:
    """The last error by kind (`rollout UNAVAILABLE`, `rejected prompt_too_long`) and how
    many of each kind so far; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._last: tuple[str, str, float] | None = None

    def record(self, kind: str, message: str) -> None:
        text = one_line(message)[:MESSAGE_CHARS]
        with self._lock:
            self._counts[kind] += 1
            self._last = (kind, text, time.time())

    def snapshot(self) -> dict[str, Any] | None:
        """{kind, message, at (unix s), count (of that kind)}; None before any error."""
        with self._lock:
            if self._last is None:
                return None
            kind, message, at = self._last
            return {"kind": kind, "message": message, "at": at, "count": self._counts[kind]}
