"""The learner's pause for an eval point (`controller.eval.hold_learner`).

The controller names the next version its eval curve evaluates (`RunKeys.eval_hold`);
the learner, once it has committed that version, waits before its next step until the
point is recorded (the key names a later version, or is gone) or `max_s` passed. So the
point samples exactly that version, and its generation has the cores the learner's step
would take. Only Redis is shared: the learner needs no eval settings, and a learner of a
run without the key never waits. docs/architecture.md, "Held-out evaluation and the eval
curve".
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass

import redis

from services.common.keys import RunKeys
from services.common.streams import last_id

BLOCK_MS = 100  # a wait re-reads the key at least this often (a failed point records none)


@dataclass(frozen=True)
class Hold:
    """Wait at `version` (once committed) for its eval point, at most `max_s` seconds."""

    version: int
    max_s: float

    def encode(self) -> str:
        return json.dumps({"version": self.version, "max_s": self.max_s})

    @classmethod
    def decode(cls, raw: bytes | str | None) -> Hold | None:
        if raw is None:
            return None
        data = json.loads(raw)
        return cls(int(data["version"]), float(data["max_s"]))


def read_hold(client: redis.Redis, keys: RunKeys) -> Hold | None:
    return Hold.decode(client.get(keys.eval_hold))


class HoldWaiter:
    """The learner's side: after each commit, wait if the controller asked for it."""

    def __init__(self, client: redis.Redis, keys: RunKeys) -> None:
        self.client, self.keys = client, keys
        self.held_at: int | None = None  # a hold is honoured once, even if never released

    def wait(self, version: int, stop: threading.Event) -> float:
        """Seconds spent waiting for the eval point of a version ≤ `version` (one GET per
        step when nothing is asked)."""
        hold = read_hold(self.client, self.keys)
        if hold is None or version < hold.version or self.held_at == hold.version:
            return 0.0
        self.held_at, started = hold.version, time.monotonic()
        deadline = started + hold.max_s
        # the stream's position before the key is read again: a point recorded after that
        # read wakes the XREAD, one recorded before it shows in the key
        seen = last_id(self.client, self.keys.evals)
        while not stop.is_set() and (left := deadline - time.monotonic()) > 0:
            now = read_hold(self.client, self.keys)
            if now is None or now.version > hold.version:
                break
            block = max(1, min(BLOCK_MS, int(left * 1000)))
            reply = self.client.xread({self.keys.evals: seen}, count=16, block=block)
            if reply:
                seen = reply[0][1][-1][0]
        return time.monotonic() - started
