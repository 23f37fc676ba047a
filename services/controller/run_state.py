"""The controller's Redis side: admission's snapshot, the in-flight moves, the pass rates.

Each move is one idempotent script (services/common/atomic.py). Pass rates are recorded
by the publish script and mirrored here in memory (loaded once at start), so admission
reads no Redis per prompt. `wait_for_change` blocks on the ledger-changes stream that
the buffer's and the learner's moves append to, instead of polling the ledger.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress

import redis
from prometheus_client import Counter

from services.common.adapters import encode_group
from services.common.atomic import (
    PassRate,
    admit_inflight_many,
    ledger_changes,
    publish_inflight_many,
    reject_inflight,
)
from services.common.keys import RunKeys
from services.common.types import Group
from services.controller.admission import Snapshot, pipeline_counts
from services.controller.dataset import Cursor
from services.controller.episode import Ticket, Timing
from services.controller.failures import Rejection

SCORED = Counter("dapo_controller_groups_scored_total", "Groups written to `scored`")
REJECTED = Counter(
    "dapo_controller_groups_rejected_total", "Groups refused for good, not retried", ["reason"]
)


class RunState:
    """One run's keys, as the controller reads and moves them (thread-safe)."""

    def __init__(self, client: redis.Redis, keys: RunKeys, history: int) -> None:
        self.client, self.keys, self.keep = client, keys, history
        self._lock = threading.Lock()
        self._rates: dict[str, list[float]] = {}
        self._seen = "0-0"  # the last ledger change waited past
        self.backlog = Backlog(client, keys)

    # -- admission's sources
    def snapshot(self) -> Snapshot:
        """Ledger counts, policy version and whether the run is done: one round trip."""
        pipe = self.client.pipeline(transaction=False)
        pipe.hgetall(self.keys.ledger)
        pipe.get(self.keys.version)
        pipe.exists(self.keys.done)
        raw, version, done = pipe.execute()
        return Snapshot(pipeline_counts(raw), int(version or 0), bool(done))

    def version(self) -> int:
        return int(self.client.get(self.keys.version) or 0)

    def load_pass_rates(self) -> int:
        """Read the recorded histories (a restarted controller goes on from them)."""
        raw = self.client.hgetall(self.keys.pass_rates)
        with self._lock:
            self._rates = {k.decode(): [float(x) for x in json.loads(v)] for k, v in raw.items()}
            return len(self._rates)

    def history(self, prompt_id: str) -> Sequence[float]:
        with self._lock:
            return tuple(self._rates.get(prompt_id, ()))

    def wait_for_change(self, timeout_s: float) -> bool:
        """Block until the buffer or the learner moved the ledger (True), or timeout."""
        stream = ledger_changes(self.keys.ledger)
        with suppress(redis.RedisError):
            reply = self.client.xread({stream: self._seen}, count=64, block=int(timeout_s * 1000))
            if reply:
                self._seen = reply[0][1][-1][0].decode()
                return True
        return False

    # -- the moves
    def admit(self, admitted: Sequence[tuple[Ticket, Cursor]]) -> list[bool]:
        """Record each group in flight, with the cursor and the ledger, in order and in one
        round trip (each move atomic alone; the cursor moves with every group); False for
        a group already in flight."""
        k = self.keys
        items = [(t.group_id, _meta(t), cursor.encode()) for t, cursor in admitted]
        return admit_inflight_many(self.client, k.inflight, k.cursor, k.ledger, items)

    def cursor(self) -> Cursor:
        return Cursor.decode(self.client.get(self.keys.cursor))

    def in_flight(self) -> list[Ticket]:
        """The groups a previous controller admitted but never published."""
        tickets = []
        for raw_id, raw_meta in self.client.hgetall(self.keys.inflight).items():
            meta = json.loads(raw_meta)
            tickets.append(Ticket(raw_id.decode(), meta["prompt_id"], meta["epoch"], meta["v"]))
        return tickets

    @contextmanager
    def generating(self, group_id: str) -> Iterator[None]:
        """An entry in the `generating` stream while the group waits for or is in
        generation (KEDA's backlog), written by the backlog's flusher (`Backlog`)."""
        self.backlog.enter(group_id)
        try:
            yield
        finally:
            self.backlog.leave(group_id)

    def publish(self, group: Group, timing: Timing) -> bool:
        """Leave `inflight` for `scored`, recording the pass rate (once per group id).

        `timing` rides beside the group as a plain stream field, for the run report's time
        accounting (`services/tools/report.py`).
        """
        return self.publish_many([(group, timing)])[0]

    def publish_many(self, items: Sequence[tuple[Group, Timing]]) -> list[bool]:
        """publish() for each, in order, in one round trip."""
        moves = [
            (
                group.group_id,
                _scored_fields(group, timing),
                PassRate(group.prompt_id, group.accuracy, self.keep),
            )
            for group, timing in items
        ]
        moved = publish_inflight_many(self.client, self.keys, moves)
        for (group, _), ok in zip(items, moved, strict=True):
            if ok:
                SCORED.inc()
                with self._lock:
                    history = self._rates.setdefault(group.prompt_id, [])
                    history.append(round(group.accuracy, 4))
                    del history[: -self.keep]
        return moved

    def reject(self, group_id: str, prompt_id: str, rejection: Rejection) -> bool:
        """Leave `inflight` for the `rejected` stream with the reason (once per group id)."""
        fields = {"prompt_id": prompt_id, "detail": rejection.detail}
        if not reject_inflight(self.client, self.keys, group_id, rejection.reason, fields):
            return False
        REJECTED.labels(rejection.reason).inc()
        return True

    def fail(self, reason: str) -> None:
        """The run cannot make progress: say why in `failed` (`dapo up` stops the run)."""
        self.client.set(self.keys.failed, reason)

    def reset_generating(self) -> None:
        """Drop a previous controller's entries; this one's are flushed from now on."""
        self.client.delete(self.keys.generating)
        self.backlog.start()

    def publish_dataset(self, counts: dict[str, int]) -> None:
        """The data as loaded into the run's `dataset` hash (the ledger's prompt accounting)."""
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(self.keys.dataset)
        pipe.hset(self.keys.dataset, mapping=counts)
        pipe.execute()


def _scored_fields(group: Group, timing: Timing) -> dict[str, bytes | str]:
    """A `scored` entry: the group, its id, and its timing (a plain field, for the run
    report's time accounting, `services/tools/report.py`)."""
    return {
        "group": encode_group(group),
        "group_id": group.group_id,
        "timing": json.dumps({"generate_s": timing.generate_s, "score_s": timing.score_s}),
    }


def _meta(ticket: Ticket) -> str:
    """What `inflight` keeps of an admitted group (read back by `in_flight`)."""
    return json.dumps({"prompt_id": ticket.prompt_id, "epoch": ticket.epoch, "v": ticket.version})


class Backlog:
    """The `generating` stream (KEDA's scaling signal: one entry per group waiting for or
    in generation), written in batches: groups entering and leaving generation are
    queued, and one pipelined round trip every `every_s` adds and deletes them (a group
    that leaves before its flush is never written). Per group that was an XADD and an
    XDEL on the group's own path; KEDA polls every 15-30 s. Best effort: a failed flush
    is tried again at the next, and a Redis blip never fails a group."""

    def __init__(self, client: redis.Redis, keys: RunKeys, every_s: float = 0.05) -> None:
        self.client, self.keys, self.every_s = client, keys, every_s
        self._lock = threading.Lock()
        self._entering: list[str] = []  # to add
        self._entries: dict[str, bytes] = {}  # added: group id -> its stream entry
        self._leaving: set[str] = set()  # left, added or being added
        self._doomed: list[bytes] = []  # entries to delete (a failed flush's)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def enter(self, group_id: str) -> None:
        with self._lock:
            self._entering.append(group_id)

    def leave(self, group_id: str) -> None:
        with self._lock:
            if group_id in self._entering:  # not written yet: never will be
                self._entering.remove(group_id)
            else:
                self._leaving.add(group_id)

    def start(self) -> None:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, daemon=True, name="backlog")
            self._thread.start()

    def close(self) -> None:
        """Stop flushing, after a last flush (the stream then holds what is in flight)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        self.flush()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.flush()

    def flush(self) -> None:
        """One round trip: the queued groups added, the entries of the left ones deleted.
        (One flusher at a time: the thread, or `close` once it has stopped.)"""
        with self._lock:
            entering, self._entering = self._entering, []
            gone = [g for g in self._leaving if g in self._entries]
            self._leaving.difference_update(gone)
            doomed, self._doomed = self._doomed + [self._entries.pop(g) for g in gone], []
        if not entering and not doomed:
            return
        pipe = self.client.pipeline(transaction=False)
        for group_id in entering:
            pipe.xadd(self.keys.generating, {"group_id": group_id})
        if doomed:
            pipe.xdel(self.keys.generating, *doomed)
        try:
            replies = pipe.execute()
        except redis.RedisError:
            with self._lock:  # the next flush tries again
                self._entering[:0] = entering
                self._doomed += doomed
            return
        with self._lock:
            self._entries.update(zip(entering, replies[: len(entering)], strict=True))
