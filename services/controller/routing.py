"""Where a group goes: the registry read at most every 50 ms, and the least-loaded
accepting rollout server, with servers that answered UNAVAILABLE routed around."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import redis

from services.common.keys import RunKeys
from services.common.registry import discover


class Router:
    """Registry lookups and the choice of rollout server (thread-safe)."""

    def __init__(self, client: redis.Redis, keys: RunKeys, shun_s: float) -> None:
        self.client, self.keys, self.shun_s = client, keys, shun_s
        self._lock = threading.Lock()
        self._load: Counter[str] = Counter()
        self._shunned: dict[str, float] = {}  # rollout address -> monotonic time it may return
        self._registry: dict[str, tuple[float, list[dict[str, Any]]]] = {}

    def instances(self, role: str) -> list[dict[str, Any]]:
        """Registered instances of a role, re-read from Redis at most every 50 ms.

        Every admission check and every group asks; a SCAN each time would put Redis
        round trips on the hot path for no fresher answer than the heartbeats give.
        """
        now = time.monotonic()
        cached = self._registry.get(role)
        if cached is None or now - cached[0] > 0.05:
            cached = (now, discover(self.client, self.keys, role))
            self._registry[role] = cached
        return cached[1]

    @contextmanager
    def rollout(self, groups: int = 1) -> Iterator[str | None]:
        """The accepting rollout server with the fewest of our groups in flight, loaded
        with `groups` more while the block runs (None when none is registered).

        `accepting`, not `ready`: a server a version behind still takes the call and
        waits for the weights the request's min_version names (rollout/server.py). A
        server that answered UNAVAILABLE lately is used only if no other one is left.
        """
        ready = [i["address"] for i in self.instances("rollout") if i.get("accepting")]
        if not ready:
            yield None
            return
        with self._lock:
            now = time.monotonic()
            usable = [a for a in ready if self._shunned.get(a, 0.0) <= now] or ready
            address = min(usable, key=lambda a: self._load[a])
            self._load[address] += groups
        try:
            yield address
        finally:
            with self._lock:
                self._load[address] -= groups

    def shun(self, address: str) -> None:
        """Route around `address`, which answered UNAVAILABLE, for one registry TTL: a
        dead server's entry lives that long, and as its calls fail at once it would
        otherwise look least loaded and draw most new groups until it expires."""
        now = time.monotonic()
        with self._lock:
            self._shunned = {a: t for a, t in self._shunned.items() if t > now}
            self._shunned[address] = now + self.shun_s
