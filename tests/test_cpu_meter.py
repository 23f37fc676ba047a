"""CPU per step by role (`dapo up`'s summary line): process trees read from /proc, the
torch engine's own model CPU, and the window's arithmetic."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.tools.cpu_meter import (
    CpuMeter,
    Sample,
    cpu_line,
    cpu_seconds,
    process_table,
    tree_cpu,
)

BURN = "import time\nt=time.process_time()\nwhile time.process_time()-t<{s}: pass\n"


def test_a_process_tree_counts_its_live_descendants() -> None:
    """A parent that waits on a child burning CPU: the tree has the child's CPU, the
    parent's own entry (and a synthetic table's arithmetic) agree."""
    burn = BURN.format(s=20)
    parent = f"import subprocess,sys; subprocess.run([sys.executable, '-c', {burn!r}])"
    proc = subprocess.Popen([sys.executable, "-c", parent], start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while cpu_seconds(proc.pid) < 0.5 and time.monotonic() < deadline:
            time.sleep(0.05)
        table = process_table()
        assert tree_cpu(proc.pid, table) >= 0.5 > table[proc.pid][1]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the child too
        proc.wait()
    synthetic = {10: (1, 0.25), 11: (10, 1.0), 12: (11, 2.0), 13: (1, 4.0)}
    assert tree_cpu(10, synthetic) == 3.25 and tree_cpu(12, synthetic) == 2.0


def test_per_step_splits_services_model_and_learner() -> None:
    roles = ("controller", "buffer", "reward", "redis", "dapo up", "rollout", "learner")
    first = Sample(2, dict.fromkeys(roles, 1.0), model=0.5)
    last = Sample(
        12,
        {
            "controller": 1.2,
            "buffer": 1.1,
            "reward": 1.3,
            "redis": 1.05,
            "dapo up": 1.01,
            "rollout": 2.0,
            "learner": 3.0,
        },
        model=1.1,
    )
    cpu = CpuMeter(samples=[first, last]).per_step()
    assert cpu is not None and cpu["steps"] == 10
    assert cpu["model"] == 0.06 and cpu["rollout_outside_model"] == 0.04
    # controller .02 + buffer .01 + reward .03 + redis .005 + dapo up .001 + rollout .04
    assert cpu["services"] == 0.106
    line = cpu_line(cpu)
    assert line.startswith("CPU per step (s, over 10 steps): services 0.106 (controller 0.020")
    assert "rollout outside the model 0.040); model 0.060, learner 0.200" in line


def test_a_restarted_role_or_an_unmeasured_model_leaves_services_out() -> None:
    roles = ("controller", "buffer", "reward", "redis", "dapo up", "rollout")
    first = Sample(1, dict.fromkeys(roles, 5.0), model=None)
    last = Sample(5, {**dict.fromkeys(roles, 6.0), "reward": 0.2}, model=None)  # restarted
    cpu = CpuMeter(samples=[first, last]).per_step()
    assert cpu is not None and "reward" not in cpu["by_role"]  # type: ignore[operator]
    assert "services" not in cpu and "model" not in cpu
    assert "services (not measured)" in cpu_line(cpu)
    assert CpuMeter(samples=[first]).per_step() is None


def test_observe_samples_only_when_the_step_moves() -> None:
    meter = CpuMeter(every_s=0.0)
    pids = {"dapo up": [os.getpid()], "me": [os.getpid()]}
    for step in (0, 1, 1, 2, 2, 3):
        meter.observe(step, lambda: pids, lambda: 0.0)
    assert [s.step for s in meter.samples] == [1, 2, 3]
    assert meter.samples[-1].by_role["me"] >= meter.samples[0].by_role["me"] > 0
    resumed = CpuMeter(every_s=0.0)  # a resumed run's bar starts at its checkpoint's step
    for step in (28, 28, 29, 30):
        resumed.observe(step, lambda: pids, lambda: 0.0)
    assert [s.step for s in resumed.samples] == [29, 30]  # not while its services start


def test_the_torch_engine_measures_its_model_cpu(tiny_model: Path) -> None:
    from rollout.engine import SamplingParams
    from rollout.torch_engine import TorchEngine

    engine = TorchEngine(tiny_model, dtype="float32")
    assert engine.model_cpu_seconds() == 0.0
    engine.generate([[1, 2, 3]] * 4, SamplingParams(n=8, max_tokens=4))
    assert engine.model_cpu_seconds() > 0.0


def test_a_sample_without_the_models_cpu_narrows_the_window_to_those_with_it() -> None:
    """A /status that did not answer in time leaves one sample without `model`: the
    window is the samples that have it, not a report without the model."""
    roles = ("controller", "buffer", "reward", "redis", "dapo up", "rollout")
    samples = [
        Sample(1, dict.fromkeys(roles, 1.0), model=None),
        Sample(3, dict.fromkeys(roles, 2.0), model=0.4),
        Sample(7, dict.fromkeys(roles, 3.0), model=0.8),
        Sample(9, dict.fromkeys(roles, 4.0), model=None),
    ]
    cpu = CpuMeter(samples=samples).per_step()
    assert cpu is not None and cpu["steps"] == 4 and cpu["model"] == 0.1
    assert cpu["by_role"]["controller"] == 0.25  # type: ignore[index]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_cpu_seconds_counts_descendants() -> None:
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass\n"
    child = subprocess.Popen([sys.executable, "-c", burn + "time.sleep(30)"])
    try:
        deadline = time.monotonic() + 30
        while cpu_seconds(child.pid) < 0.5 and time.monotonic() < deadline:
            time.sleep(0.05)
        child_cpu, own = cpu_seconds(child.pid), time.process_time()
        assert child_cpu >= 0.5
        tick = 2 / os.sysconf("SC_CLK_TCK")  # /proc counts in clock ticks
        assert cpu_seconds(os.getpid()) >= child_cpu + own - tick
    finally:
        child.kill()
        child.wait()
