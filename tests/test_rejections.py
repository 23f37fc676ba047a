"""Nothing is retried that cannot succeed: the controller against a real rollout server and
a real reward service rejects the groups they refuse for good (an overlong prompt, a ground
truth past the reward's limit) at once, with a reason, and keeps retrying what is
transient; a run whose every group is rejected stops with that reason, and a rollout
server whose tokenizer is not the controller's stops the run at its first refusal."""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2
from grpc_health.v1 import health_pb2_grpc as grpc_health
from messy_data import HUGE_GROUND_TRUTH, OVERLONG, clean_rows, row, write_parquet
from rollout_fixtures import Served, make_config, serve

from reward.server import RewardServer
from reward.server import create_server as create_reward_server
from services.common.data import PromptRecord
from services.common.errors import DapoError
from services.common.keys import RunKeys
from services.common.ledger import read_ledger
from services.common.net import free_port
from services.common.registry import Registration
from services.controller.admission import pipeline_counts, staleness_allows
from services.controller.dataset import Cursor
from services.controller.failures import GroupRejected, Rejection, RejectionStreak, classify
from services.controller.server import REJECTED, RETRIES, Controller
from services.tools.config import DapoConfig, load_config
from services.tools.ledger import format_ledger

RUN = "rej"


@pytest.fixture(scope="module")
def reward_server() -> Iterator[RewardServer]:
    config = DapoConfig.model_validate(
        {"reward": {"num_workers": 1, "server": {"grpc_port": 0, "http_port": 0}}}
    )
    server = create_reward_server(config).start()
    assert server.scorer.pool.wait_ready(60), "verifier workers did not start"
    yield server
    server.stop()


@pytest.fixture
def rollout(tiny_model: Path) -> Iterator[Served]:
    with serve(tiny_model, make_config(RUN)) as served:
        yield served


def register(client: redis.Redis, role: str, port: int) -> None:
    """An entry the controller's router finds (no heartbeat: it lives registry_ttl_s)."""
    info = {"address": f"127.0.0.1:{port}", "accepting": True, "ready": True}
    Registration(client, RunKeys(RUN), role, f"{role}-t", info, ttl_s=60).refresh()


MODEL: dict[str, Path] = {}  # the tiny model, whose tokenizer renders the prompts


@pytest.fixture(autouse=True)
def _tiny_model(tiny_model: Path) -> None:
    MODEL["tiny"] = tiny_model


def controller(client: redis.Redis, data: Path, *overrides: str) -> Controller:
    """A controller on `data` that lets prompts of up to 32 tokens through, to a rollout
    server whose limit is 12 (rollout_fixtures): the server's refusal is what is tested."""
    config = load_config(
        preset="tiny",
        env={},
        overrides=[
            f"shared.run_name={RUN}",
            "shared.group_size=2",
            "shared.max_prompt_length=32",
            f"shared.model_path={MODEL['tiny']}",
            "controller.dataset.kind=parquet",
            f"controller.dataset.path={data}",
            "controller.eval.enabled=false",
            "controller.max_groups_in_flight=4",
            *overrides,
        ],
    )
    return Controller(config, client)


def run_until(c: Controller, done, timeout: float = 60) -> BaseException | None:
    """Run the controller's loop until `done()` or it stops itself; what it raised."""
    stop, raised = threading.Event(), []

    def target() -> None:
        try:
            c.run(stop)
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=target)
    thread.start()
    deadline = time.monotonic() + timeout
    while thread.is_alive() and not done() and time.monotonic() < deadline:
        time.sleep(0.05)
    stop.set()
    thread.join(timeout=30)
    assert not thread.is_alive(), "the controller did not stop"
    assert done() or raised, "neither done nor stopped in time"
    return raised[0] if raised else None


def test_refused_groups_are_rejected_with_their_reason_not_retried(
    tmp_path: Path, redis_client: redis.Redis, rollout: Served, reward_server: RewardServer
) -> None:
    rows = [*clean_rows(2), row(OVERLONG, "9", "long"), row("9,1,9=", HUGE_GROUND_TRUTH, "huge")]
    c = controller(redis_client, write_parquet(tmp_path / "d.parquet", rows))
    assert len(c.records) == 4  # nothing screened here: the servers refuse
    register(redis_client, "rollout", rollout.server.grpc_port)
    register(redis_client, "reward", reward_server.grpc_port)
    retries = RETRIES.labels("rollout")._value.get() + RETRIES.labels("reward")._value.get()
    too_long = REJECTED.labels("prompt_too_long")._value.get()

    def both_rejected_twice() -> bool:
        rejected = read_ledger(redis_client, RUN).rejected
        return (
            rejected.get("prompt_too_long", 0) >= 2
            and rejected.get("ground_truth_too_long", 0) >= 2
        )

    assert run_until(c, both_rejected_twice) is None
    ledger = read_ledger(redis_client, RUN)
    assert not ledger.problems(), ledger.problems()
    assert set(ledger.rejected) == {"prompt_too_long", "ground_truth_too_long"}
    assert ledger.scored >= 2  # the clean prompts went through
    # Once per admission, never retried (each refused call counts no retry).
    after = RETRIES.labels("rollout")._value.get() + RETRIES.labels("reward")._value.get()
    assert after == retries
    assert (
        REJECTED.labels("prompt_too_long")._value.get() - too_long
        == ledger.rejected["prompt_too_long"]
    )
    entries = redis_client.xrange(RunKeys(RUN).rejected)
    by_reason = {f[b"reason"].decode(): f for _, f in entries}
    assert by_reason["prompt_too_long"][b"prompt_id"] == b"messy-long"
    assert b"exceeds shared.max_prompt_length=12" in by_reason["prompt_too_long"][b"detail"]
    assert b"reward.max_ground_truth_chars" in by_reason["ground_truth_too_long"][b"detail"]
    assert ledger.dataset == {"rows": 4, "usable": 4, "filtered": {}}
    printed = format_ledger(ledger)  # what `dapo ledger` prints
    assert "rejected: prompt_too_long" in printed and "identity holds" in printed
    status = c.status()
    assert status["last_error"]["kind"].startswith("rejected ")
    assert status["ledger"]["rejected"] == ledger.rejected


def test_a_run_whose_every_group_is_rejected_stops_with_the_reason(
    tmp_path: Path, redis_client: redis.Redis, rollout: Served, reward_server: RewardServer
) -> None:
    rows = [row(OVERLONG + str(i), "9", f"long-{i}") for i in range(3)]
    data = write_parquet(tmp_path / "d.parquet", rows)
    # Past the staleness window (tiny: about 64 undecided groups): rejected groups are over,
    # not undecided work admission waits for.
    c = controller(redis_client, data, "controller.max_rejected_in_a_row=100")
    register(redis_client, "rollout", rollout.server.grpc_port)
    register(redis_client, "reward", reward_server.grpc_port)
    started = time.monotonic()
    raised = run_until(c, lambda: False, timeout=90)
    assert isinstance(raised, DapoError), raised
    assert time.monotonic() - started < 60
    reason = redis_client.get(RunKeys(RUN).failed).decode()
    assert str(raised) == reason and "\n" not in reason
    assert "groups were all rejected (prompt_too_long" in reason
    assert "exceeds shared.max_prompt_length=12" in reason
    assert read_ledger(redis_client, RUN).rejected["prompt_too_long"] >= 100


def test_a_rollout_server_with_another_tokenizer_stops_the_run_with_one_line(
    tmp_path: Path, redis_client: redis.Redis, reward_server: RewardServer
) -> None:
    """rollout.model_path naming another model than shared.model_path: every prompt the
    controller renders would be read with the wrong vocabulary or template."""
    other = Path(shutil.copytree(MODEL["tiny"], tmp_path / "other-model"))
    config = json.loads((other / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}={{ m['content'] }}{% endfor %}"
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    (other / "chat_template.jinja").unlink(missing_ok=True)
    c = controller(redis_client, write_parquet(tmp_path / "d.parquet", clean_rows(2)))
    with serve(other, make_config(RUN)) as rollout:
        register(redis_client, "rollout", rollout.server.grpc_port)
        register(redis_client, "reward", reward_server.grpc_port)
        raised = run_until(c, lambda: False, timeout=60)
    assert isinstance(raised, DapoError), raised
    reason = redis_client.get(RunKeys(RUN).failed).decode()
    assert str(raised) == reason and "\n" not in reason
    assert reason.startswith(
        f"tokenizer_mismatch: the prompt was tokenized by tokenizer {c.tokenizer.fingerprint}"
    )
    assert "one model path must decide every role's tokenizer" in reason


def test_an_unreachable_server_is_retried_not_rejected(
    tmp_path: Path, redis_client: redis.Redis
) -> None:
    """UNAVAILABLE (nobody listens there) is transient: retried with backoff until the run
    stops; nothing is rejected and the groups stay in flight for the next controller."""
    c = controller(redis_client, write_parquet(tmp_path / "d.parquet", clean_rows(2)))
    register(redis_client, "rollout", free_port())
    retries = RETRIES.labels("rollout")._value.get()
    assert run_until(c, lambda: RETRIES.labels("rollout")._value.get() >= retries + 4) is None
    ledger = read_ledger(redis_client, RUN)
    assert not ledger.problems(), ledger.problems()
    assert ledger.rejected == {} and ledger.scored == 0 and ledger.in_flight >= 1
    assert c.status()["last_error"]["kind"] == "rollout UNAVAILABLE"


def test_classify_transient_and_permanent() -> None:
    channel = grpc.insecure_channel(f"127.0.0.1:{free_port()}")
    with pytest.raises(grpc.RpcError) as unavailable:  # a real error: nobody serves there
        grpc_health.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    channel.close()
    assert unavailable.value.code() == grpc.StatusCode.UNAVAILABLE
    assert classify(unavailable.value, "rollout") is None
    assert classify(ConnectionError("no ready rollout server"), "rollout") is None
    rejection = classify(ValueError("expected 16 samples, got 3"), "rollout")
    assert rejection is not None and rejection.reason == "rollout_bad_response"
    assert classify(GroupRejected(rejection), "reward") == rejection
    assert classify(RuntimeError("a bug"), "rollout") is None  # not ours to judge


def test_rejection_streak() -> None:
    streak = RejectionStreak(3)
    too_long = Rejection("prompt_too_long", "prompt of 20 tokens exceeds ...")
    for _ in range(2):
        streak.rejected(too_long)
    assert streak.verdict() is None
    streak.success()
    for _ in range(3):
        streak.rejected(too_long)
    verdict = streak.verdict()
    assert verdict is not None and verdict.startswith("the last 3 groups were all rejected")
    assert RejectionStreak(0).verdict() is None


def test_rejected_groups_are_not_undecided_work() -> None:
    raw = {
        b"admitted": b"70",
        b"kept": b"3",
        b"filtered:all_wrong": b"2",
        b"rejected:prompt_too_long": b"60",
        b"rejected:ground_truth_too_long": b"4",
    }
    counts = pipeline_counts(raw)
    assert counts.rejected == 64 and counts.undecided == 1
    assert staleness_allows(counts, 0.5, batch_groups=16, max_staleness=1)


def test_a_resumed_group_whose_prompt_is_gone_is_rejected(
    tmp_path: Path, redis_client: redis.Redis
) -> None:
    """A restarted controller whose data no longer holds a group's prompt (edited, or now
    skipped at load) accounts for the group instead of leaving it in flight for good."""
    c = controller(redis_client, write_parquet(tmp_path / "d.parquet", clean_rows(2)))
    gone = PromptRecord("messy-gone", "1,2,3=", "3", "messy")
    group_id = c.admit([(Cursor(0, 1), gone)], 0)[0].group_id
    with ThreadPoolExecutor(2) as pool:
        assert c.resume_inflight(pool, threading.Event()) == 1
    ledger = read_ledger(redis_client, RUN)
    assert ledger.rejected == {"unknown_prompt": 1} and ledger.in_flight == 0
    assert not ledger.problems(), ledger.problems()
    ((_, fields),) = redis_client.xrange(RunKeys(RUN).rejected)
    assert fields[b"group_id"] == group_id.encode() and fields[b"prompt_id"] == b"messy-gone"


def test_the_dashboard_shows_rejections_by_reason() -> None:
    dashboard = json.loads(Path("deploy/grafana/dashboards/dapo.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert (
        "sum by (reason) (rate(dapo_controller_groups_rejected_total[$__rate_interval]))" in exprs
    )
    assert "max by (reason) (dapo_controller_prompts_filtered_at_load)" in exprs
