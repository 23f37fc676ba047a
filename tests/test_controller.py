"""Controller pieces that need Redis but no other service."""

from __future__ import annotations

import contextlib
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
from services.common.atomic import ack_then, commit_step
from services.common.keys import RunKeys
from services.common.ledger import read_ledger
from services.common.net import free_port
from services.common.registry import Registration
from services.common.types import Group, Sample
from services.controller import adapter, server
from services.controller.dataset import Cursor
from services.controller.episode import Generated, Timing
from services.controller.failures import Stopped
from services.controller.routing import Router
from services.controller.run_state import RunState
from services.controller.scoring import ScoreBatcher, split
from services.controller.server import REJECTED, Controller
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


def test_pacing_counts_stepped_groups_before_they_are_acked(redis_client: redis.Redis) -> None:
    c = controller(redis_client)
    redis_client.hset(RunKeys("c").ledger, mapping={"admitted": 40, "kept": 32, "stepped": 16})
    counts = c.state.snapshot().counts
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
    snap = c.state.snapshot()
    assert (snap.version, snap.done) == (7, False) and snap.counts.admitted == 0
    record = c.records[0]
    group_id = c.admit([(Cursor(0, 1), record)], snap.version)[0].group_id
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
    sampling = c.config.shared.sampling

    def generate() -> None:
        with contextlib.suppress(Stopped):
            c.rollouts.generate("g", c.records[0], 2, sampling, 0, stop)

    worker = threading.Thread(target=generate)
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


# -- the loop on a real Redis, its clients replaced by fakes of our own protocols ---------


class Failing:
    """A Generator with a bug: every call raises."""

    def generate(self, request_id, record, n, sampling, min_version, stop) -> Generated:
        raise RuntimeError("a bug in generation")


class Stalling:
    """A Generator that never answers before the controller stops."""

    def generate(self, request_id, record, n, sampling, min_version, stop) -> Generated:
        stop.wait()
        raise Stopped(request_id)


@contextlib.contextmanager
def running(c: Controller) -> Iterator[threading.Thread]:
    stop = threading.Event()
    thread = threading.Thread(target=c.run, args=(stop,))
    thread.start()
    try:
        yield thread
    finally:
        stop.set()
        thread.join(timeout=30)
        assert not thread.is_alive(), "the controller did not stop"


def test_an_unexpected_failure_rejects_the_group_and_clears_it_from_inflight(
    redis_client: redis.Redis,
) -> None:
    c = controller(
        redis_client,
        "controller.max_groups_in_flight=2",
        "controller.max_rejected_in_a_row=0",
        "controller.eval.enabled=false",
    )
    c.episode.generator = Failing()
    with running(c):
        wait_until(lambda: read_ledger(redis_client, "c").rejected.get("controller_error", 0) >= 4)
    ledger = read_ledger(redis_client, "c")
    assert not ledger.problems(), ledger.problems()
    assert ledger.in_flight == 0 and ledger.rejected == {"controller_error": ledger.admitted}
    _, fields = redis_client.xrange(RunKeys("c").rejected, count=1)[0]
    assert fields[b"reason"] == b"controller_error"
    assert fields[b"detail"] == b"RuntimeError: a bug in generation"
    assert REJECTED.labels("controller_error")._value.get() >= ledger.admitted


def hgetall_calls(client: redis.Redis) -> int:
    return int(client.info("commandstats").get("cmdstat_hgetall", {}).get("calls", 0))


def test_blocked_admission_waits_for_the_ledger_to_move_instead_of_polling(
    redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server, "WAKE_S", 30.0)  # only a notification can wake it in time
    c = controller(redis_client, "controller.max_train_backlog=2", "controller.eval.enabled=false")
    c.episode.generator = Stalling()
    keys = c.keys
    redis_client.hset(keys.ledger, mapping={"admitted": 2, "kept": 2})  # the backlog is full
    with running(c):
        time.sleep(1.0)  # starting up
        before = hgetall_calls(redis_client)
        time.sleep(1.5)
        assert hgetall_calls(redis_client) - before < 5  # a 10 ms poll: about 150
        assert read_ledger(redis_client, "c").admitted == 2
        started = time.monotonic()
        commit_step(redis_client, keys, 1, 2, "{}", "{}")  # the learner stepped on both
        wait_until(lambda: read_ledger(redis_client, "c").admitted > 2, timeout=10)
        assert time.monotonic() - started < 5


def scored_group(record, group_id: str, correct: list[bool]) -> Group:
    samples = [Sample([1], [-0.1], "x", "stop", 0, correct=ok) for ok in correct]
    return Group(group_id, record.prompt_id, record.prompt, [1], record.ground_truth, samples)


def test_pass_rates_are_recorded_where_groups_are_published_and_survive_a_restart(
    redis_client: redis.Redis,
) -> None:
    # difficulty window 2 (the default; the tiny preset's is 0), at most 8 epochs: 5 kept
    c = controller(redis_client, "controller.difficulty_window=2")
    record = c.records[0]
    rates = [0.5, 1.0, 0.25, 0.75, 0.0, 0.0]
    for i, rate in enumerate(rates):
        group_id = c.admit([(Cursor(0, i + 1), record)], 0)[0].group_id
        group = scored_group(record, group_id, [True] * int(4 * rate) + [False] * int(4 - 4 * rate))
        assert c.state.publish(group, Timing(0.1, 0.2))
    assert not c.state.publish(group, Timing(0.1, 0.2))  # a replay records nothing twice
    stored = json.loads(redis_client.hget(RunKeys("c").pass_rates, record.prompt_id))
    assert stored == rates[1:] == list(c.state.history(record.prompt_id))
    assert c.admission.skip_reason(record.prompt_id) == "hard"
    restarted = controller(redis_client, "controller.difficulty_window=2")
    assert restarted.admission.skip_reason(record.prompt_id) is None  # not loaded yet
    assert restarted.state.load_pass_rates() == 1
    assert restarted.admission.skip_reason(record.prompt_id) == "hard"
    ledger = read_ledger(redis_client, "c")
    assert (ledger.scored, ledger.in_flight) == (6, 0) and not ledger.problems()


def test_a_buffer_decision_or_a_learner_ack_wakes_admission(redis_client: redis.Redis) -> None:
    """The moves that can free admission append to the ledger-changes stream; a blocked
    controller's read returns at once, and times out when nothing moved."""
    keys = RunKeys("c")
    state = RunState(redis_client, keys, history=5)
    assert not state.wait_for_change(0.2)
    redis_client.xgroup_create(keys.scored, "buffer", id="0", mkstream=True)
    entry = redis_client.xadd(keys.scored, {"group": b"x"})
    redis_client.xreadgroup("buffer", "b", {keys.scored: ">"})
    started = time.monotonic()
    ack_then(redis_client, keys.scored, "buffer", [entry.decode()], keys.ledger, ["filtered:x"])
    assert state.wait_for_change(10) and time.monotonic() - started < 5
    assert not state.wait_for_change(0.2)  # seen: no second wake for the same move
    ack_then(redis_client, keys.scored, "buffer", [entry.decode()], keys.ledger, ["filtered:x"])
    assert not state.wait_for_change(0.2)  # a replayed ack moved nothing
