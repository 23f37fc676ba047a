"""Controller pieces that need Redis but no other service."""

from __future__ import annotations

import json

import redis

from services.common.config import load_config
from services.common.keys import RunKeys
from services.controller.server import Controller


def controller(client: redis.Redis, *overrides: str) -> Controller:
    config = load_config(preset="tiny", env={}, overrides=["shared.run_name=c", *overrides])
    return Controller(config, client)


def test_difficulty_skip_expires_so_prompts_are_retried(redis_client: redis.Redis) -> None:
    c = controller(redis_client, "controller.difficulty_window=2")
    record = c.records[0]
    redis_client.hset(RunKeys("c").pass_rates, record.prompt_id, json.dumps([0.0, 0.0]))
    assert c.skip_reason(record) == "hard"  # sits out one epoch
    assert c.skip_reason(record) is None  # then is tried again
    assert c.skip_reason(record) == "hard"
    redis_client.hset(RunKeys("c").pass_rates, record.prompt_id, json.dumps([0.5, 1.0]))
    assert c.skip_reason(record) is None  # informative recently: never skipped


def test_difficulty_skip_is_off_by_default(redis_client: redis.Redis) -> None:
    c = controller(redis_client)
    record = c.records[0]
    redis_client.hset(RunKeys("c").pass_rates, record.prompt_id, json.dumps([1.0, 1.0]))
    assert c.skip_reason(record) is None


def test_pacing_counts_stepped_groups_before_they_are_acked(redis_client: redis.Redis) -> None:
    c = controller(redis_client)
    redis_client.hset(RunKeys("c").ledger, mapping={"admitted": 40, "kept": 32, "stepped": 16})
    counts = c.counts()
    assert counts.trained == 16 and counts.queued_informative == 16
