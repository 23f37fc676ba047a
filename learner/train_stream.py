"""Rank 0's consumer on the `train` stream: which groups the next step trains, and acks.

Own pending entries (delivered before a restart, never acked) are read first, in stream
order. Entries up to the checkpoint cursor were trained before a crash: they are acked
and counted `trained` only. Groups past the hard staleness bound
(`services/common/staleness.py`, the rule the buffer also applies) are acked and counted
`dropped:stale` in one transaction at once. A batch is ready when full, or once
`learner.generation_budget` is spent and it holds a group.
"""

from __future__ import annotations

import threading

import redis
from prometheus_client import Counter

from learner.config import LearnerSettings
from services.common.adapters import decode_group
from services.common.atomic import ack_then, commit_step
from services.common.generation_budget import batch_ready, decided_groups
from services.common.keys import RunKeys
from services.common.staleness import judge, staleness
from services.common.streams import Entry, StreamConsumer
from services.common.types import Group

GROUPS = Counter("dapo_learner_groups_total", "Groups consumed", ["outcome"])
for _outcome in ("trained", "dropped_stale"):  # at 0 from the start: a panel shows 0, not "No data"
    GROUPS.labels(_outcome)
CONSUMER_GROUP = "learner"


def stream_id(entry_id: str) -> tuple[int, int]:
    """A Redis stream id as a comparable (ms, seq)."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


class TrainStream:
    """The groups held for the next step, read from `train`, and the acks of those done."""

    def __init__(self, config: LearnerSettings, client: redis.Redis) -> None:
        self.config, self.client = config, client
        self.keys = RunKeys(config.shared.run_name)
        self.consumer = StreamConsumer(client, self.keys.train, CONSUMER_GROUP, "learner-0")
        self.held: list[tuple[Entry, Group]] = []
        self._pending_after: str | None = "0-0"  # replay own pending entries first
        self._decided_mark = self._decided()  # the generation budget counts from here
        self.generated = 0  # groups decided while the batch being trained filled

    def _drop_stale(self, entry: Entry) -> None:
        k = self.keys
        ack_then(self.client, k.train, CONSUMER_GROUP, [entry.id], k.ledger, ["dropped:stale"])
        GROUPS.labels("dropped_stale").inc()

    def ack_trained(self, ids: list[str]) -> None:
        """Ack and count `trained`; entries already acked are not counted again."""
        ack_then(self.client, self.keys.train, CONSUMER_GROUP, ids, self.keys.ledger, ["trained"])

    def verdict(self, group: Group, version: int) -> str:
        """The staleness verdict on `group` for a learner at policy `version`."""
        shared = self.config.shared
        lag = staleness(group, version)
        return judge(lag, shared.max_staleness, shared.staleness_hard_bound)

    def take(self, entries: list[Entry], version: int, cursor: str) -> None:
        """Add groups within the hard staleness bound to the batch; drop (and count) others.

        Entries up to the checkpoint `cursor` were trained before a crash: ack them only.
        """
        done = stream_id(cursor)
        self.ack_trained([e.id for e in entries if stream_id(e.id) <= done])
        for entry in (e for e in entries if stream_id(e.id) > done):
            group = decode_group(entry.fields["group"])
            if self.verdict(group, version) == "too_stale":
                self._drop_stale(entry)
            else:
                self.held.append((entry, group))

    def recheck_held(self, version: int) -> None:
        """Drop held groups that the last step pushed past the hard bound."""
        held, self.held = self.held, []
        for entry, group in held:
            if self.verdict(group, version) == "too_stale":
                self._drop_stale(entry)
            else:
                self.held.append((entry, group))

    def _read_pending(self, count: int) -> list[Entry]:
        """The next page of entries delivered before a restart and never acked."""
        assert self._pending_after is not None
        entries = self.consumer.read_own_pending(count, after=self._pending_after)
        if entries:
            self._pending_after = entries[-1].id
        else:
            self._pending_after = None
        return entries

    def _decided(self) -> int:
        """Groups the buffer has decided so far (kept + filtered), from the ledger."""
        raw = self.client.hgetall(self.keys.ledger)
        return decided_groups({k.decode(): int(v) for k, v in raw.items()})

    def _ready(self, need: int) -> bool:
        """The batch is full, or `learner.generation_budget` is spent and it holds a group
        (services/common/generation_budget.py); then the next budget starts counting."""
        decided = self._decided()
        generated = decided - self._decided_mark
        budget = self.config.learner.generation_budget
        if not batch_ready(len(self.held), need, generated, budget):
            return False
        self._decided_mark, self.generated = decided, generated
        return True

    def fill(self, stop: threading.Event, version: int, cursor: str) -> bool:
        """Block until train_batch_groups fresh groups are held, or fewer once the
        generation budget is spent (False if stopping)."""
        if stop.is_set():
            return False
        need = self.config.shared.train_batch_groups
        self.recheck_held(version)
        while self._pending_after is not None and len(self.held) < need:
            self.take(self._read_pending(need - len(self.held)), version, cursor)
        while not self._ready(need):
            if stop.is_set():
                return False
            self.take(self.consumer.read(need - len(self.held), block_ms=200), version, cursor)
        return True

    def next_batch(self) -> list[tuple[Entry, Group]]:
        """The held groups the next step trains (at most train_batch_groups), in order."""
        need = self.config.shared.train_batch_groups
        batch, self.held = self.held[:need], self.held[need:]
        return batch

    def commit(self, version: int, ids: list[str], record: str, trace: str, ack: bool) -> None:
        """One transaction: the new version, the step's record and trace, and (`ack`:
        without checkpoints) the acks of its entries; then count them `trained`."""
        commit_step(
            self.client,
            self.keys,
            version,
            len(ids),
            record,
            trace,
            (CONSUMER_GROUP, ids) if ack else None,
        )
        GROUPS.labels("trained").inc(len(ids))
