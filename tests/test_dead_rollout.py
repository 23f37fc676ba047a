"""A dead or stalled rollout server never blocks the learner (docs/reliability.md).

The learner never calls a rollout server; rollout servers pull its weights
(GetVersion/FetchWeights). Two tests of what that buys:

- stalled readers: FetchWeights streams that read one bucket and then stop reading hold
  a learner gRPC thread each (flow control), yet the learner commits steps meanwhile and
  another reader fetches the newest version at once, bit for bit; the stalled readers'
  threads come back when they disconnect;
- a rollout server SIGKILLed and kept dead during a `dapo up` run: the learner keeps
  committing steps, the run finishes, the ledger holds, no group is trained twice, and
  the controller re-routes the dead server's groups to the live one;
- the same with partial rollouts and longer responses, the kill landing just after a
  weight swap, i.e. while responses continued across versions are in flight: their
  partial output dies with the server, the groups are generated again elsewhere.
"""

from __future__ import annotations

import inspect
import re
import signal
import threading
import time
from pathlib import Path

import grpc
import psutil
import pytest
import redis
import torch
from learner_fixtures import TORCH_FP32_STEP, fill_train, learner_config
from run_audit import assert_trained_once, children_of

from dapo.v1 import learner_pb2
from learner.server import LearnerServer
from rollout.weights import WeightStub
from services.common.adapters import decode_group
from services.common.grpc_server import start_grpc_server
from services.common.keys import RunKeys
from services.common.ledger import read_ledger
from services.common.redis_server import RedisServer
from services.common.registry import discover
from services.tools.config import DapoConfig, load_config
from services.tools.launcher import Launch, launch
from services.weight_transport.assembly import WeightAssembler
from services.weight_transport.torch_codec import to_torch

BATCH = 2  # groups per learner step in the stalled-reader test
# The learner's gRPC threads (LearnerServer keeps start_grpc_server's default).
POOL = inspect.signature(start_grpc_server).parameters["max_workers"].default
STALLED = POOL - 1  # the most stalled readers beside which others are still served


class StalledReader:
    """A FetchWeights stream that read its first bucket and reads no more.

    Without BDP probing its receive window stays at 64 KiB, so the learner's sending
    thread blocks on flow control after ~90 KiB of the tiny model's 0.5 MB (with probing
    the window grows to megabytes and a small model is buffered whole).
    """

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address, options=[("grpc.http2.bdp_probe", 0)])
        request = learner_pb2.FetchWeightsRequest(bucket_bytes=1024)
        self.stream = WeightStub(self.channel).FetchWeights(request, timeout=30)
        self.assembler = WeightAssembler()
        self.assembler.add(next(self.stream))

    def finish(self) -> dict[str, torch.Tensor]:
        """Read the rest: the version whose first bucket was read, whatever came since."""
        for bucket in self.stream:
            self.assembler.add(bucket)
        return weights(self.assembler)

    def close(self) -> None:
        self.channel.close()


def weights(assembler: WeightAssembler) -> dict[str, torch.Tensor]:
    return {t.name: to_torch(t) for t in assembler.result()}


def fetch(address: str, timeout: float) -> tuple[int, int, dict[str, torch.Tensor]]:
    """(GetVersion, the fetched version, its weights) as a rollout server pulls them."""
    with grpc.insecure_channel(address) as channel:
        stub = WeightStub(channel)
        offered = stub.GetVersion(learner_pb2.GetVersionRequest(), timeout=timeout).version
        assembler = WeightAssembler()
        for bucket in stub.FetchWeights(learner_pb2.FetchWeightsRequest(), timeout=timeout):
            assembler.add(bucket)
        return offered, assembler.version, weights(assembler)


def assert_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def snapshot(server: LearnerServer) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in server.learner.policy.named_weights()}


def assert_threads_come_back_and_are_bounded(
    address: str, stalled: list[StalledReader], version: int
) -> list[StalledReader]:
    """Disconnecting gives the stalled readers' threads back (as many stall again and a
    fresh reader is still served); one more stalled reader takes the last thread, and
    the next reader waits (for the stalled calls' deadline, weights_timeout_s in a run).
    docs/reliability.md states the bound; if this fails, update it there. Returns the
    readers still open."""
    for reader in stalled:
        reader.close()
    stalled = [StalledReader(address) for _ in range(STALLED)]
    assert {r.assembler.version for r in stalled} == {version}
    assert fetch(address, timeout=5)[1] == version
    stalled.append(StalledReader(address))
    with pytest.raises(grpc.RpcError) as waited:
        fetch(address, timeout=1)
    assert waited.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    return stalled


def test_stalled_weight_readers_never_block_the_learner(
    tiny_model: Path, redis_client: redis.Redis
) -> None:
    run, steps = "stalled", 3
    sets = {**TORCH_FP32_STEP, "shared.train_batch_groups": BATCH, "learner.total_steps": steps}
    config = learner_config(tiny_model, run, sets)
    fill_train(redis_client, run, BATCH * steps, seed=5)
    server = LearnerServer(config, redis_client).start()
    address = f"127.0.0.1:{server.grpc_port}"
    stalled: list[StalledReader] = []
    try:
        before = snapshot(server)  # version 0, the initial model
        stalled = [StalledReader(address) for _ in range(STALLED)]
        assert {r.assembler.version for r in stalled} == {0}

        # The learner trains, commits and publishes while they hold their threads.
        stop, step_s = threading.Event(), []
        for _ in range(steps):
            started = time.monotonic()
            assert server.learner.fill_batch(stop)
            server.learner.train_once()
            step_s.append(time.monotonic() - started)
        assert server.learner.version == int(redis_client.get(RunKeys(run).version)) == steps
        assert max(step_s) < 10, step_s

        # Another reader gets the newest version at once, bit for bit.
        started = time.monotonic()
        offered, version, got = fetch(address, timeout=5)
        fetch_s = time.monotonic() - started
        assert offered == version == steps
        assert_bitwise(got, snapshot(server))
        assert any(not torch.equal(got[n], t) for n, t in before.items())  # it trained

        # A stalled reader that reads on gets the version it started, whole and unmixed.
        assert_bitwise(stalled.pop().finish(), before)
        print(
            f"\n{STALLED} stalled readers: steps {[round(s, 2) for s in step_s]} s, "
            f"fresh fetch of version {version} in {fetch_s:.2f} s"
        )

        stalled = assert_threads_come_back_and_are_bounded(address, stalled, steps)
    finally:
        for reader in stalled:
            reader.close()
        server.stop()


# --------------------------------------------------------------------------- a dead server
RUN, STEPS, KILL_AFTER = "deadroll", 12, 2
# Responses long enough and weights polled often enough that the kill lands among responses
# continued across a weight update.
PARTIAL_ROLLOUTS = (
    "shared.max_response_length=64",
    "rollout.partial_rollouts=true",
    "rollout.weight_poll_s=0.05",
)
KEYS = RunKeys(RUN)
# A batch (controller.groups_per_call) names its groups comma-joined.
FAILED = re.compile(r"rollout for (\S+)(?: and \d+ more)? failed, retrying")


def audited_run(model: Path, run: str, redis_url: str, *overrides: str, preset: str = "tiny"):
    """The config of a `launch`ed run on the test's Redis whose ledger the test audits
    exactly: every stream entry kept (the audit reads all of `scored`), full batches (no
    generation budget: the counts), no evaluation, no learner lingering at the end."""
    return load_config(
        preset=preset,
        overrides=[
            f"shared.model_path={model}",
            f"shared.run_name={run}",
            f"shared.redis_url={redis_url}",
            "controller.eval.enabled=false",
            "learner.linger_s=0",
            "buffer.stream_retain=1000000",
            "learner.generation_budget=null",
            *overrides,
        ],
    )


def listening_ports(pid: int) -> set[int]:
    conns = psutil.Process(pid).net_connections("tcp")
    return {c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN}


class KeepDead:
    """The launcher's on_step hook: once `after` steps are committed, SIGKILL one rollout
    server, taking it off the launcher's list first so that the supervisor never sees it
    die and never restarts it; then note the registered rollout servers on every call."""

    def __init__(self, client: redis.Redis, victim: str, after: int) -> None:
        self.client, self.victim, self.after = client, victim, after
        self.killed_at: float | None = None  # wall clock, as in Redis stream ids
        self.version_at_kill = self.log_offset = 0
        self.exit_code: int | None = None
        self.dead: dict = {}  # the victim's registry entry
        self.live: dict = {}  # the other one's
        self.problems_at_kill: list[str] = []
        self.seen: list[tuple[float, set[str]]] = []  # (seconds after the kill, instances)

    def __call__(self, launch: Launch, step: int, done: bool) -> None:
        if self.killed_at is None and step >= self.after:
            self.kill(launch)
        elif self.killed_at is not None:
            alive = {i["instance"] for i in discover(self.client, KEYS, "rollout")}
            if not self.client.exists(KEYS.done):  # at the end the live one leaves too
                self.seen.append((time.time() - self.killed_at, alive))

    def kill(self, launch: Launch) -> None:
        child = next(c for c in launch.children if c.name == self.victim)
        ports = listening_ports(child.proc.pid)
        for entry in discover(self.client, KEYS, "rollout"):
            mine = int(entry["address"].rsplit(":", 1)[1]) in ports
            setattr(self, "dead" if mine else "live", entry)
        self.log_offset = (launch.run_dir / "logs" / "controller.log").stat().st_size
        launch.children.remove(child)
        self.killed_at = time.time()
        child.proc.send_signal(signal.SIGKILL)
        self.exit_code = child.proc.wait()
        child.log_file.close()
        self.version_at_kill = int(self.client.get(KEYS.version) or 0)
        self.problems_at_kill = read_ledger(self.client, RUN).problems()


def launch_and_kill(config: DapoConfig, run_dir: Path, hook: KeepDead) -> None:
    """`launch` the run with two rollout servers, `hook` killing one: the run ends well,
    the victim died of SIGKILL, and the ledger held at the kill."""
    code = launch(config, run_dir=str(run_dir), steps=STEPS, rollouts=2, on_step=hook)
    assert code == 0 and hook.exit_code == -signal.SIGKILL
    assert not hook.problems_at_kill, hook.problems_at_kill


def failed_on(log: str, address: str) -> set[str]:
    """Groups whose Generate failed on the server at `address`: refused there, or cut off
    when it died (the calls it was serving end with "Socket closed" or a reset)."""
    records = re.split(r"\n(?=\d\d:\d\d:\d\d )", log)
    cut_off = ("Socket closed", "Connection reset by peer")
    return {
        group_id
        for r in records
        if (m := FAILED.search(r)) and (address in r or any(c in r for c in cut_off))
        for group_id in m.group(1).split(",")
    }


def appended(client: redis.Redis, stream: str, field: bytes) -> list[tuple[str, float]]:
    """(value of `field`, when appended) per entry; a stream id starts with Redis's clock."""
    return [(f[field].decode(), int(eid.split(b"-")[0]) / 1000) for eid, f in client.xrange(stream)]


def assert_registry_dropped(hook: KeepDead, client: redis.Redis, ttl: float) -> list[float]:
    """The registry dropped the dead server within its TTL; the live one stayed, alone.
    (The run may end before the TTL: the controller routes around a server that
    answered UNAVAILABLE, so the remaining steps need not wait for the registry.)
    Returns the seconds after the kill at which it was seen gone (empty: after the run)."""
    assert hook.killed_at is not None
    gone = [s for s, alive in hook.seen if hook.dead["instance"] not in alive]
    if gone:
        assert gone[0] < ttl + 2
        assert {hook.live["instance"]} == set().union(*(a for s, a in hook.seen if s >= gone[0]))
    else:
        time.sleep(max(0.0, hook.killed_at + ttl + 2 - time.time()))
        alive = {i["instance"] for i in discover(client, KEYS, "rollout")}
        assert hook.dead["instance"] not in alive
    return gone


def assert_nothing_lost(client: redis.Redis, scored: int, batch_groups: int) -> None:
    """The ledger holds, every step committed once, no group trained twice."""
    ledger, _ = assert_trained_once(client, RUN, STEPS, batch_groups)
    assert ledger.trained == STEPS * batch_groups
    assert scored == ledger.scored and scored + ledger.in_flight == ledger.admitted


@pytest.mark.slow
def test_a_rollout_server_killed_and_kept_dead_never_blocks_the_run(
    killed_run_dir: Path, tiny_model: Path, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    run_dir = killed_run_dir
    config = audited_run(tiny_model, RUN, redis_server.url)
    hook = KeepDead(redis_client, "rollout-0", KILL_AFTER)
    started = time.monotonic()
    launch_and_kill(config, run_dir, hook)
    wall = time.monotonic() - started
    assert hook.killed_at is not None

    # The learner went on: every step committed, most of them after the kill.
    commits = [t for _, t in appended(redis_client, KEYS.steps, b"json")]
    after = [t - hook.killed_at for t in commits if t > hook.killed_at]
    assert len(commits) == STEPS == int(redis_client.get(KEYS.version))
    assert len(after) >= STEPS - hook.version_at_kill >= STEPS - KILL_AFTER - 2
    gaps = [b - a for a, b in zip([0.0, *after], after, strict=False)]

    gone = assert_registry_dropped(hook, redis_client, config.shared.registry_ttl_s)

    # The controller re-routed what the dead server had or was sent: each such group was
    # then generated by the live one and scored once, or was still being retried when
    # the run ended (then it is in flight, and the ledger counts it so).
    log = (run_dir / "logs" / "controller.log").read_text()[hook.log_offset :]
    failed = failed_on(log, hook.dead["address"])
    scored_list = appended(redis_client, KEYS.scored, b"group_id")
    scored = dict(scored_list)
    assert len(scored) == len(scored_list)  # no group scored twice
    in_flight = {g.decode() for g in redis_client.hkeys(KEYS.inflight)}
    rerouted = {g: scored[g] - hook.killed_at for g in failed if g in scored}
    # Some may still wait out a backoff when the run ends (a group that waited for a
    # ready server at start-up has grown its backoff to the 5 s cap); they are in flight.
    assert failed and failed <= rerouted.keys() | in_flight, failed - scored.keys() - in_flight
    first = min(rerouted.values(), default=float("nan"))
    print(
        f"\nkilled {hook.victim} at version {hook.version_at_kill}: {len(after)} steps "
        f"committed after it, the first {after[0]:.1f} s after, longest gap "
        f"{max(gaps):.1f} s, last {after[-1]:.1f} s; {len(failed)} groups failed on the "
        f"dead server, {len(rerouted)} re-routed and scored (the first {first:.1f} s "
        f"after); registry dropped it {f'{gone[0]:.1f} s after' if gone else 'after the run'}; "
        f"run {wall:.0f} s"
    )

    assert_nothing_lost(redis_client, len(scored), config.shared.train_batch_groups)
    assert not children_of(run_dir)


class KillMidResponse(KeepDead):
    """KeepDead whose kill waits `delay_s` after the step it follows: by then the servers
    have pulled the new weights and swapped them in between two tokens of what they are
    generating, so the victim dies holding partial rollouts."""

    def __init__(self, client: redis.Redis, victim: str, after: int, delay_s: float) -> None:
        super().__init__(client, victim, after)
        self.delay_s = delay_s

    def kill(self, launch: Launch) -> None:
        time.sleep(self.delay_s)
        super().kill(launch)


@pytest.mark.slow
def test_a_rollout_server_killed_mid_partial_rollout_loses_nothing(
    killed_run_dir: Path, tiny_model: Path, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    run_dir = killed_run_dir
    config = audited_run(tiny_model, RUN, redis_server.url, *PARTIAL_ROLLOUTS)
    hook = KillMidResponse(redis_client, "rollout-0", KILL_AFTER, delay_s=0.3)
    launch_and_kill(config, run_dir, hook)
    batch = config.shared.train_batch_groups
    spanning, failed = assert_cut_off_regenerated(redis_client, run_dir, hook, batch)
    print(
        f"\n{spanning} responses spanned versions; {failed} groups cut off on the "
        f"dead server, all generated again or in flight"
    )


def assert_cut_off_regenerated(
    client: redis.Redis, run_dir: Path, hook: KeepDead, batch_groups: int
) -> tuple[int, int]:
    """After a kill among partial rollouts: some response was continued across a weight
    update, every group cut off on the dead server was generated again or is in flight,
    nothing was lost, and no process of the run is left. Returns (responses that spanned
    versions, groups cut off)."""
    scored = [decode_group(f[b"group"]) for _, f in client.xrange(KEYS.scored)]
    spanning = [s for g in scored for s in g.samples if len(set(s.versions())) > 1]
    assert spanning, "no response was continued across a weight update"
    log = (run_dir / "logs" / "controller.log").read_text()[hook.log_offset :]
    failed = failed_on(log, hook.dead["address"])
    in_flight = {g.decode() for g in client.hkeys(KEYS.inflight)}
    assert failed and failed <= {g.group_id for g in scored} | in_flight
    assert_nothing_lost(client, len(scored), batch_groups)
    assert not children_of(run_dir)
    return len(spanning), len(failed)
