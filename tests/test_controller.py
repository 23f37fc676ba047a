"""Controller pieces that need Redis but no other service."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import redis

from dapo.v1 import reward_pb2, reward_pb2_grpc
from reward.server import RewardServer, create_server
from services.common.keys import RunKeys
from services.common.net import free_port
from services.common.registry import Registration
from services.controller import adapter
from services.controller.dataset import Cursor
from services.controller.routing import Router
from services.controller.scoring import ScoreBatcher, split
from services.controller.server import Controller
from services.tools.config import DapoConfig, load_config

MODEL: dict[str, Path] = {}  # the tiny model, whose tokenizer renders the prompts


@pytest.fixture(autouse=True)
def _tiny_model(tiny_model: Path) -> None:
    MODEL["tiny"] = tiny_model


def controller(client: redis.Redis, *overrides: str) -> Controller:
    config = load_config(
        preset="tiny",
        env={},
        overrides=["shared.run_name=c", f"shared.model_path={MODEL['tiny']}", *overrides],
    )
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


def test_a_prompt_that_stays_easy_sits_out_longer_each_time(redis_client: redis.Redis) -> None:
    c = controller(redis_client)  # difficulty-aware admission is on by default
    record = c.records[0]
    rates = RunKeys("c").pass_rates

    def visits(history: list[float], n: int) -> list[str | None]:
        redis_client.hset(rates, record.prompt_id, json.dumps(history))
        return [c.skip_reason(record) for _ in range(n)]

    assert visits([1.0, 1.0], 2) == ["easy", None]  # one epoch out, then admitted
    assert visits([1.0, 1.0, 1.0], 3) == ["easy", "easy", None]  # easy again: two
    assert visits([1.0] * 8, 9) == ["easy"] * 8 + [None]  # at most difficulty_skip_epochs
    assert visits([1.0] * 8 + [0.5], 1) == [None]


def test_the_ablation_base_samples_every_prompt_as_the_paper(redis_client: redis.Redis) -> None:
    overrides = ["shared.run_name=c", f"shared.model_path={MODEL['tiny']}"]
    config = load_config(preset="tiny_runmax", env={}, overrides=overrides)
    c = Controller(config, redis_client)
    record = c.records[0]
    redis_client.hset(RunKeys("c").pass_rates, record.prompt_id, json.dumps([1.0, 1.0]))
    assert c.skip_reason(record) is None


def test_pacing_counts_stepped_groups_before_they_are_acked(redis_client: redis.Redis) -> None:
    c = controller(redis_client)
    redis_client.hset(RunKeys("c").ledger, mapping={"admitted": 40, "kept": 32, "stepped": 16})
    counts = c.counts()
    assert counts.trained == 16 and counts.queued_informative == 16


# -- batched scoring against a real reward service --------------------------------------


@pytest.fixture(scope="module")
def reward_server() -> Iterator[RewardServer]:
    config = DapoConfig.model_validate(
        {
            "reward": {
                "num_workers": 1,
                "max_response_chars": 64,
                "server": {"grpc_port": 0, "http_port": 0},
            }
        }
    )
    server = create_server(config).start()
    assert server.scorer.pool.wait_ready(60), "verifier workers did not start"
    yield server
    server.stop()


class GatedCalls:
    """Real Score calls, recorded; the first one waits until the test opens the gate, so
    the groups submitted meanwhile are queued together."""

    def __init__(self, port: int) -> None:
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.stub = reward_pb2_grpc.RewardServiceStub(self.channel)
        self.sizes: list[int] = []
        self.gate = threading.Event()

    def __call__(self, request: reward_pb2.ScoreRequest) -> reward_pb2.ScoreResponse:
        self.sizes.append(len(request.items))
        self.gate.wait(30)
        return self.stub.Score(request, timeout=30)


def group_request(g: int, n: int = 4, response: str | None = None) -> reward_pb2.ScoreRequest:
    """n items of group g; the first is correct, and every pred names the group."""
    return reward_pb2.ScoreRequest(
        items=[
            reward_pb2.ScoreItem(
                id=f"g{g}/{i}",
                response=response or str(g),
                ground_truth=str(g if i == 0 else g + 1),
                verifier=reward_pb2.VERIFIER_FIRST_INTEGER,
            )
            for i in range(n)
        ]
    )


def score_concurrently(batcher: ScoreBatcher, calls: GatedCalls, requests: list) -> list:
    """Submit requests[0] (whose call blocks), queue the rest, then open the gate."""
    with ThreadPoolExecutor(len(requests)) as pool:
        futures = [pool.submit(batcher.score, requests[0])]
        wait_until(lambda: calls.sizes)
        futures += [pool.submit(batcher.score, r) for r in requests[1:]]
        wait_until(lambda: batcher._queue.qsize() == len(requests) - 1)
        calls.gate.set()
        return [f.exception() or f.result() for f in futures]


def wait_until(predicate, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_groups_share_score_calls_within_limits_and_get_their_own_results(
    reward_server: RewardServer,
) -> None:
    calls = GatedCalls(reward_server.grpc_port)
    batcher = ScoreBatcher(calls, max_items=8, max_bytes=1 << 20)
    try:
        results = score_concurrently(batcher, calls, [group_request(g) for g in range(4)])
    finally:
        batcher.close()
    # Group 0 alone, then the three queued groups in calls of at most 8 items.
    assert calls.sizes == [4, 8, 4]
    for g, response in enumerate(results):
        assert [r.pred for r in response.results] == [str(g)] * 4
        assert [r.correct for r in response.results] == [True, False, False, False]


def test_a_refused_group_fails_alone(reward_server: RewardServer) -> None:
    calls = GatedCalls(reward_server.grpc_port)
    batcher = ScoreBatcher(calls, max_items=64, max_bytes=1 << 20)
    too_long = "9" * 100  # beyond reward.max_response_chars: INVALID_ARGUMENT
    requests = [
        group_request(0),
        group_request(1),
        group_request(2, response=too_long),
        group_request(3),
    ]
    try:
        results = score_concurrently(batcher, calls, requests)
    finally:
        batcher.close()
    assert calls.sizes[:2] == [4, 12]  # merged, refused, then one group per call
    assert sorted(calls.sizes[2:]) == [4, 4, 4]
    assert isinstance(results[2], grpc.RpcError)
    assert results[2].code() == grpc.StatusCode.INVALID_ARGUMENT
    for g in (0, 1, 3):
        assert [r.pred for r in results[g].results] == [str(g)] * 4


def test_split_refuses_a_short_response() -> None:
    requests = [group_request(0, n=2), group_request(1, n=3)]
    short = reward_pb2.ScoreResponse(results=[reward_pb2.ScoreResult()] * 4)
    with pytest.raises(ValueError, match="4 results for 5 items"):
        split(short, requests)


def test_groups_ask_for_the_version_current_at_admission(redis_client: redis.Redis) -> None:
    c = controller(redis_client)
    redis_client.set(RunKeys("c").version, 7)
    counts, version, done = c.snapshot()
    assert (version, done) == (7, False) and counts.admitted == 0
    record = c.records[0]
    group_id = c.admit(Cursor(0, 1), record, version)
    meta = json.loads(redis_client.hget(RunKeys("c").inflight, group_id))
    assert meta["v"] == 7  # a restarted controller asks for the same min_version
    fingerprint = c.tokenizer.fingerprint
    sampling = c.config.shared.sampling
    request = adapter.generate_request(
        group_id, record, 16, sampling, 4, fingerprint, min_version=meta["v"]
    )
    assert request.min_version == 7
    assert list(request.prompt_token_ids) == record.prompt_token_ids != []
    assert request.tokenizer_fingerprint == fingerprint


def pick(router: Router) -> str | None:
    with router.rollout() as address:
        return address


def test_a_rollout_server_that_answered_unavailable_is_routed_around(
    redis_client: redis.Redis,
) -> None:
    """A dead server's calls fail at once, so by load alone it would draw every new group
    until its registry entry expires; after UNAVAILABLE it is used only as a last resort."""
    c = controller(redis_client)
    dead, live = f"127.0.0.1:{free_port()}", "127.0.0.1:1"
    entries = [
        Registration(redis_client, c.keys, "rollout", name, {"address": a, "accepting": True})
        for name, a in (("a-dead", dead), ("b-live", live))
    ]
    for entry in entries:
        entry.refresh()  # no heartbeat thread: the entries live 5 s, enough for this test
    router = c.router
    router._load[live] += 3  # the live one is busy: load alone would pick the dead one
    assert pick(router) == dead
    stop = threading.Event()
    worker = threading.Thread(target=c.generate, args=("g", c.records[0], 0, stop))
    worker.start()  # its first call goes to the dead server and fails with UNAVAILABLE
    deadline = time.monotonic() + 20
    while dead not in router._shunned and time.monotonic() < deadline:
        time.sleep(0.01)
    stop.set()
    worker.join(timeout=20)
    assert dead in router._shunned
    router._shunned.pop(live, None)  # a retry may have reached the stand-in "live" address
    for entry in entries:
        entry.refresh()
    assert {pick(router) for _ in range(5)} == {live}  # despite its load
    router._shunned[live] = time.monotonic() + 60  # every server shunned: still route somewhere
    assert pick(router) in (dead, live)
    assert router._load == {live: 3, dead: 0}  # every pick was released
