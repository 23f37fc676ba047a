"""The learner's pause for an eval point (`controller.eval.hold_learner`): the controller
names the next version it evaluates, the learner waits after committing it until the
point is recorded, a failed point or a lost controller never stalls it for longer than
`hold_max_s`. Real Redis; the controller's side is the Evaluator's own record()."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import redis

from services.common.eval_hold import HoldWaiter, read_hold
from services.common.keys import RunKeys
from services.controller.config import ControllerSettings
from services.controller.evaluation import Evaluator, due, next_due


def evaluator(client: redis.Redis, hold: bool = True, max_s: float = 10.0) -> Evaluator:
    eval_cfg = {"every_steps": 5, "hold_learner": hold, "hold_max_s": max_s}
    config = ControllerSettings.model_validate({"controller": {"eval": eval_cfg}})
    keys = RunKeys(config.shared.run_name)
    return Evaluator(SimpleNamespace(config=config, client=client, keys=keys), [])  # type: ignore[arg-type]


def point(version: int) -> dict:
    return {
        "version": version,
        "step": version,
        "n": 4,
        "avg@4": 0.5,
        "pass@4": 0.75,
        "response_length": 2.0,
        "truncation_rate": 0.0,
        "seconds": 0.1,
    }


def later(seconds: float, action) -> threading.Thread:
    thread = threading.Thread(target=lambda: (time.sleep(seconds), action()))
    thread.start()
    return thread


def test_next_due_is_the_first_version_due_evaluates() -> None:
    assert next_due(None, 10) == 0
    for every in (1, 3, 10):
        for last in range(0, 40):
            first = next(v for v in range(last + 1, last + 2 * every + 1) if due(v, every, last))
            assert next_due(last, every) == first


def test_the_learner_waits_until_the_point_of_its_version_is_recorded(
    redis_client: redis.Redis,
) -> None:
    ev = evaluator(redis_client)
    ev.ask_hold(0)
    waiter, stop = HoldWaiter(redis_client, ev.keys), threading.Event()
    assert read_hold(redis_client, ev.keys).version == 5
    assert waiter.wait(4, stop) == 0.0  # not there yet: no pause
    recorder = later(0.4, lambda: ev.record(point(5), 5))
    held = waiter.wait(5, stop)
    recorder.join()
    assert 0.35 <= held < 2.0
    assert read_hold(redis_client, ev.keys).version == 10  # released by naming the next
    assert redis_client.xlen(ev.keys.evals) == 1
    assert waiter.wait(6, stop) == 0.0


def test_a_failed_point_releases_the_learner_too(redis_client: redis.Redis) -> None:
    ev = evaluator(redis_client)
    ev.ask_hold(5)
    waiter = HoldWaiter(redis_client, ev.keys)
    recorder = later(0.3, lambda: ev.record(None, 10))  # the evaluation raised: no point
    held = waiter.wait(11, threading.Event())
    recorder.join()
    assert 0.25 <= held < 1.5 and redis_client.xlen(ev.keys.evals) == 0


def test_an_unreleased_hold_costs_at_most_max_s_once(redis_client: redis.Redis) -> None:
    """A controller that died mid-point: the learner goes on after hold_max_s, and does
    not wait again for the same version."""
    ev = evaluator(redis_client, max_s=0.3)
    ev.ask_hold(5)
    waiter, stop = HoldWaiter(redis_client, ev.keys), threading.Event()
    assert 0.28 <= waiter.wait(10, stop) < 1.0
    assert waiter.wait(11, stop) == 0.0


def test_a_stop_ends_the_wait(redis_client: redis.Redis) -> None:
    ev = evaluator(redis_client)
    ev.ask_hold(10)
    stop = threading.Event()
    later(0.2, stop.set)
    assert 0.15 <= HoldWaiter(redis_client, ev.keys).wait(15, stop) < 0.5


@pytest.mark.parametrize("hold", [False, True])
def test_no_hold_asked_means_no_pause(redis_client: redis.Redis, hold: bool) -> None:
    ev = evaluator(redis_client, hold=hold)
    ev.ask_hold(None)
    if hold:  # the first point: the learner's first commit waits for it
        assert read_hold(redis_client, ev.keys).version == 0
        redis_client.delete(ev.keys.eval_hold)  # what start_evaluation does first
    assert HoldWaiter(redis_client, ev.keys).wait(7, threading.Event()) == 0.0
