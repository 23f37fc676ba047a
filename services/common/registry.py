"""Service discovery through Redis: each instance keeps a key alive with a heartbeat.

A process that dies stops refreshing its key, which then expires after `ttl_s`; so the
controller never routes to a dead rollout server for longer than one TTL. Each entry
names the run id of its key space (`run_id`); `discover` skips another run's.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import redis

from services.common.keys import RunKeys


class Registration:
    """Announce `info` under role/instance and refresh it every ttl/3 seconds."""

    def __init__(
        self,
        client: redis.Redis,
        keys: RunKeys,
        role: str,
        instance: str,
        info: dict[str, Any],
        ttl_s: float = 5.0,
    ) -> None:
        self.client, self.keys, self.ttl_s = client, keys, ttl_s
        self.key = f"{keys.registry(role)}:{instance}"
        self.info = dict(info, instance=instance)
        self._lock = threading.Lock()  # a heartbeat must not re-send info older than an update
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True, name=f"heartbeat-{role}")

    def start(self) -> Registration:
        run_id = current_run(self.client, self.keys)
        if run_id is not None:
            self.info["run_id"] = run_id
        self.refresh()
        self._thread.start()
        return self

    def refresh(self) -> None:
        with self._lock:
            self.client.set(self.key, json.dumps(self.info), px=int(self.ttl_s * 1000))

    def update(self, **info: Any) -> None:
        """Change the announced info (e.g. readiness, served version)."""
        with self._lock:
            self.info.update(info)
            self.client.set(self.key, json.dumps(self.info), px=int(self.ttl_s * 1000))

    def _beat(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                self.refresh()
            except redis.RedisError:
                continue  # Redis restarting: the next beat re-announces us

    def stop(self) -> None:
        self._stop.set()
        try:
            self.client.delete(self.key)
        except redis.RedisError:
            pass


def current_run(client: redis.Redis, keys: RunKeys) -> str | None:
    """The id of the run that owns the key space (None: no `dapo up` claimed it)."""
    raw = client.get(keys.run_id)
    return raw.decode() if isinstance(raw, bytes) else raw


def discover(client: redis.Redis, keys: RunKeys, role: str) -> list[dict[str, Any]]:
    """Live instances of a role of this run, sorted by instance name."""
    found = []
    run_id = current_run(client, keys)
    for key in client.scan_iter(match=f"{keys.registry(role)}:*", count=100):
        raw = client.get(key)
        if raw is not None:
            found.append(json.loads(raw))
    mine = [i for i in found if run_id is None or i.get("run_id", run_id) == run_id]
    return sorted(mine, key=lambda info: info["instance"])
