"""The controller's batched Redis moves on a real Redis: admissions and publications of a
burst in one round trip each, with the same effects as the moves made one by one (the
ledger, the cursor, `inflight`, `scored`, the pass rates) and the same once-only rule."""

from __future__ import annotations

import numpy as np
import redis

from services.common.adapters import decode_group
from services.common.keys import RunKeys
from services.common.types import Group, Sample
from services.controller.dataset import Cursor
from services.controller.episode import Ticket, Timing
from services.controller.run_state import RunState

KEYS = RunKeys("batches")


def group(group_id: str, prompt_id: str, correct: list[bool]) -> Group:
    samples = [
        Sample(
            np.array([5, 6], dtype=np.int32),
            np.array([-0.5, -0.25], dtype=np.float32),
            "5",
            "stop",
            3,
            reward=1.0 if c else -1.0,
            correct=c,
        )
        for c in correct
    ]
    return Group(group_id, prompt_id, "3,5,1=", [1, 2], "5", samples, run_id="batches")


def test_a_burst_admits_and_publishes_as_one_by_one_would(redis_client: redis.Redis) -> None:
    state = RunState(redis_client, KEYS, history=3)
    tickets = [Ticket(f"e0-{i}", f"p{i}", 0, 4) for i in range(3)]
    state.admit([(t, Cursor(0, i + 1)) for i, t in enumerate(tickets)])
    assert state.cursor() == Cursor(0, 3)  # the last admission's cursor
    assert int(redis_client.hget(KEYS.ledger, "admitted")) == 3
    assert sorted(t.group_id for t in state.in_flight()) == ["e0-0", "e0-1", "e0-2"]
    assert state.in_flight()[0].version == 4
    state.admit([(tickets[0], Cursor(0, 3))])  # again: not counted twice
    assert int(redis_client.hget(KEYS.ledger, "admitted")) == 3

    groups = [group("e0-0", "p0", [True, False]), group("e0-1", "p1", [True, True])]
    timing = Timing(0.5, 0.25)
    assert state.publish_many([(g, timing) for g in groups]) == [True, True]
    assert [t.group_id for t in state.in_flight()] == ["e0-2"]
    assert int(redis_client.hget(KEYS.ledger, "scored")) == 2
    entries = redis_client.xrange(KEYS.scored)
    assert [decode_group(f[b"group"]).group_id for _, f in entries] == ["e0-0", "e0-1"]
    assert tuple(state.history("p1")) == (1.0,) and tuple(state.history("p0")) == (0.5,)
    # once only: the published group again, beside the one still in flight
    third = group("e0-2", "p2", [False, False])
    assert state.publish_many([(groups[0], timing), (third, timing)]) == [False, True]
    assert int(redis_client.hget(KEYS.ledger, "scored")) == 3
    assert tuple(state.history("p0")) == (0.5,)  # not recorded twice
    assert state.in_flight() == []
