"""Bounded dynamic sampling: when a step stops waiting for a full batch (the pure rule),
and the learner training the short batch it holds, exactly, and saying so."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
from dapo_cli import run_ok, set_args
from learner_fixtures import learner_config, make_groups

from learner.server import Learner
from services.common.adapters import encode_group
from services.common.generation_budget import batch_ready, budget_spent, decided_groups
from services.common.keys import RunKeys
from services.tools.cli import up_argv


def test_decided_counts_kept_and_every_filter_reason() -> None:
    ledger = {
        "admitted": 90,
        "scored": 80,
        "kept": 5,
        "filtered:acc": 70,
        "filtered:stale": 2,
        "dropped:stale": 1,
        "trained": 4,
    }
    assert decided_groups(ledger) == 77


def test_a_full_batch_is_always_ready() -> None:
    assert batch_ready(16, 16, 0, None)
    assert batch_ready(16, 16, 0, 4.0)


def test_without_a_budget_a_step_waits_for_a_full_batch() -> None:
    assert not batch_ready(15, 16, 10_000, None)  # the paper: refill until full


def test_past_the_budget_a_step_trains_what_it_holds() -> None:
    assert not budget_spent(63, 16, 4.0) and budget_spent(64, 16, 4.0)
    assert not batch_ready(5, 16, 63, 4.0)
    assert batch_ready(5, 16, 64, 4.0)
    assert batch_ready(1, 16, 64, 4.0)


def test_a_step_never_trains_nothing() -> None:
    assert not batch_ready(0, 16, 10_000, 4.0)


# -- the learner: a short batch trained and reported ------------------------------------


def _learner_config(model: Path, run: str, batch: int, budget: float | None) -> Any:
    sets = {
        "shared.train_batch_groups": batch,
        "learner.engine": "torch",
        "learner.optimizer.lr": 1e-2,
        "learner.optimizer.warmup_steps": 0,
        "learner.batching.mini_batch_responses": 8,
        "learner.batching.micro_batch_tokens": 64,
        "learner.generation_budget": "null" if budget is None else budget,
        "learner.total_steps": 1,
    }
    return learner_config(model, run, sets, env={})


def _stop_after(seconds: float) -> threading.Event:
    """A stop event that fires by itself: a learner that would wait forever returns."""
    stop = threading.Event()
    timer = threading.Timer(seconds, stop.set)
    timer.daemon = True
    timer.start()
    return stop


def _weights(learner: Learner) -> dict[str, torch.Tensor]:
    return {n: w.detach().clone() for n, w in learner.policy.named_weights()}


def test_past_the_budget_the_learner_trains_a_short_batch_exactly(
    tiny_model: Path, redis_client: redis.Redis
) -> None:
    """Need 4, budget 2 x 4 = 8 groups: with 3 informative groups held the step waits
    until 8 are decided, then trains the 3 exactly as a full batch of 3 would, and says so."""
    groups = make_groups(n_groups=3, seed=21)
    for run in ("short", "full"):
        for g in groups:
            redis_client.xadd(RunKeys(run).train, {"group": encode_group(g)})
    learner = Learner(_learner_config(tiny_model, "short", 4, 2.0), redis_client)
    ledger = RunKeys("short").ledger
    redis_client.hset(ledger, mapping={"kept": 3, "filtered:acc": 4})  # 7 decided
    assert not learner.fill_batch(
        _stop_after(1.0)
    )  # 7 < 8 generated: still waiting for a full batch
    assert len(learner.stream.held) == 3
    redis_client.hincrby(ledger, "filtered:acc", 1)  # the 8th decided group
    assert learner.fill_batch(_stop_after(30.0))
    learner.train_once()
    learner.publisher.wait()

    (record,) = [json.loads(f[b"json"]) for _, f in redis_client.xrange(RunKeys("short").metrics)]
    assert record["groups"] == 3 and record["generated"] == 8
    assert record["tokens"] == sum(len(s.token_ids) for g in groups for s in g.samples)
    assert int(redis_client.hget(ledger, "stepped") or 0) == 3

    full = Learner(_learner_config(tiny_model, "full", 3, None), redis_client)
    assert full.fill_batch(threading.Event())
    full.train_once()
    full.publisher.wait()
    short_w, full_w = _weights(learner), _weights(full)
    assert all(torch.equal(short_w[n], full_w[n]) for n in full_w)
    base = Learner(_learner_config(tiny_model, "base", 3, None), redis_client)
    assert any(not torch.equal(_weights(base)[n], full_w[n]) for n in full_w)  # it trained


# -- `dapo up`: short steps trained and reported -------------------------------------------


@pytest.mark.slow
def test_dapo_up_trains_short_batches_past_the_budget_and_says_so(
    tmp_path: Path, tiny_model: Path
) -> None:
    """A batch of 64 groups with a budget of 1 x 64 generated, on-policy (max_staleness 0:
    admission keeps less than one batch of informative groups ahead of the learner): a
    random model's groups are informative about a third of the time, so once the learner
    has taken its first batch (which the pipeline may have filled while it started) each
    step trains fewer than 64 groups."""
    run_dir = tmp_path / "run"
    sets = [
        "shared.train_batch_groups=64",
        "shared.max_staleness=0",
        "learner.generation_budget=1",
        "controller.eval.enabled=false",
        "learner.linger_s=0",
    ]
    result = run_ok([*up_argv(run_dir, tiny_model), "--steps", "4", *set_args(sets)], 240)
    report = json.loads((run_dir / "report.json").read_text())
    steps = report["steps"]
    short = [s for s in steps if s["groups"] < 64]
    assert len(steps) == 4 and len(short) >= 2, [(s["groups"], s["generated"]) for s in steps]
    assert all(s["groups"] >= 1 and s["generated"] >= 64 for s in short)
    assert report["ledger"]["ok"] and report["ledger"]["trained"] == sum(s["groups"] for s in steps)
    assert report["dynamic_sampling"]["short_steps"] == len(short)
    assert f"{len(short)} steps trained short batches" in result.stdout
    learner_log = (run_dir / "logs" / "learner.log").read_text()
    assert learner_log.count("of 64 groups") == len(short)
