"""Several vLLM rollout servers on one machine each get their own cores.

vLLM on CPU binds its worker with VLLM_CPU_OMP_THREADS_BIND, whose default ('auto')
picks the same first cores for every server on a host: under `dapo up --rollouts 2` on
two cores both workers ran on core 0 and one server fell a minute behind (CI: 30 of 32
calls cut off by a 20 s drain). The launcher now hands each vLLM server a share
(`rollout.engine.cpu_cores`); tests/test_vllm_faults.py checks the shares in the servers'
own logs.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from services.tools.config import load_config
from services.tools.launcher import Child, Launch, core_shares, rollout_cores


@pytest.mark.parametrize(
    ("cores", "parts", "shares"),
    [
        ([0, 1], 2, ["0", "1"]),
        (list(range(16)), 4, ["0,1,2,3", "4,5,6,7", "8,9,10,11", "12,13,14,15"]),
        ([4, 5, 6], 2, ["4", "5,6"]),
        ([0, 1], 3, ["0", "1", "0"]),  # more servers than cores: one core each, in turn
        ([7], 1, ["7"]),
    ],
)
def test_core_shares(cores: list[int], parts: int, shares: list[str]) -> None:
    assert core_shares(cores, parts) == shares


@pytest.mark.parametrize(
    "cores,parts", [(list(range(n)), p) for n in (1, 2, 5, 64) for p in (1, 2, 3, 7)]
)
def test_core_shares_cover_the_cores_without_overlap(cores: list[int], parts: int) -> None:
    shares = [[int(c) for c in s.split(",")] for s in core_shares(cores, parts)]
    assert len(shares) == parts and all(shares)
    if parts <= len(cores):
        assert sorted(c for s in shares for c in s) == cores


def test_only_several_vllm_servers_without_configured_cores_get_shares() -> None:
    vllm = load_config(preset="tiny_vllm")
    shares = rollout_cores(vllm, 2)
    assert len(shares) == 2 and shares[0] != shares[1]
    assert rollout_cores(vllm, 1) == []
    assert rollout_cores(load_config(preset="tiny"), 2) == []  # the torch engine
    configured = load_config(preset="tiny_vllm", overrides=["rollout.engine.cpu_cores=0-1"])
    assert configured.rollout.engine.cpu_cores == "0-1" and rollout_cores(configured, 2) == []


def test_a_number_on_the_command_line_is_a_list_of_one_core() -> None:
    config = load_config(preset="tiny_vllm", overrides=["rollout.engine.cpu_cores=3"])
    assert config.rollout.engine.cpu_cores == "3"


def test_a_restarted_rollout_server_keeps_its_cores(tmp_path: Path) -> None:
    """`Launch.restart` starts the same command line again (here: one that fails at once,
    there is no config file; what matters is what it was started with)."""
    (tmp_path / "logs").mkdir()
    config = load_config(preset="tiny_vllm", overrides=[f"rollout.server.python={sys.executable}"])
    launch = Launch(config, tmp_path)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    extra = ("--set", "rollout.engine.cpu_cores=1")
    child = Child(
        "rollout", dead, (tmp_path / "logs" / "rollout-1.log").open("ab"), "rollout-1", extra=extra
    )
    launch.restart(child)
    try:
        assert tuple(child.proc.args[-2:]) == extra and child.restarts == 1
    finally:
        child.proc.wait(timeout=120)
        child.log_file.close()
