"""deploy/docker/entrypoint.sh's GPU slots (compose's `--scale rollout=N` on one node) and
the learner's ranks from LEARNER_GPU_IDS, with a stand-in `dapo` on PATH that records
what it was started with and stays up (a running replica)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ENTRYPOINT = ROOT / "deploy" / "docker" / "entrypoint.sh"
FAKE_DAPO = """#!/bin/sh
echo "${CUDA_VISIBLE_DEVICES:-none} ${DAPO_LEARNER__LAUNCH__RANKS:-none}" > "$REPORT"
exec sleep 60
"""


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    bin_dir, locks = tmp_path / "bin", tmp_path / "locks"
    bin_dir.mkdir(), locks.mkdir()
    (bin_dir / "dapo").write_text(FAKE_DAPO)
    (bin_dir / "dapo").chmod(0o755)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("DAPO_", "CUDA_"))}
    return {**base, "PATH": f"{bin_dir}:{os.environ['PATH']}", "DAPO_GPU_LOCK_DIR": str(locks)}


def start(env: dict[str, str], report: Path, **extra: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        ["sh", str(ENTRYPOINT), "rollout"], env={**env, **extra, "REPORT": str(report)}
    )
    deadline = time.monotonic() + 20
    while not (report.exists() and report.read_text()) and proc.poll() is None:
        assert time.monotonic() < deadline, "the entrypoint never started dapo"
        time.sleep(0.05)
    return proc


def test_replicas_claim_distinct_gpus_and_a_reset_frees_none_held(env, tmp_path) -> None:
    slots = {"DAPO_GPU_SLOTS": "0,1"}
    first = start(env, tmp_path / "r1", **slots)
    second = start(env, tmp_path / "r2", **slots)
    try:
        assert (tmp_path / "r1").read_text().split()[0] == "0"
        assert (tmp_path / "r2").read_text().split()[0] == "1"
        listing = subprocess.run(
            ["sh", str(ENTRYPOINT), "gpu-slots"], env=env, capture_output=True, text=True
        )
        assert listing.returncode == 0 and "GPU 0 held" in listing.stdout, listing.stdout
        third = subprocess.run(
            ["sh", str(ENTRYPOINT), "rollout"],
            env={**env, **slots, "REPORT": str(tmp_path / "r3")},
            capture_output=True, text=True, timeout=20,
        )  # fmt: skip
        assert third.returncode == 1 and "every GPU in DAPO_GPU_SLOTS=0,1 is taken" in third.stderr
        first.kill()
        first.wait()  # the kernel drops its lock: GPU 0 is free again, no reset needed
        again = start(env, tmp_path / "r4", **slots)
        assert (tmp_path / "r4").read_text().split()[0] == "0"
        again.kill()
        again.wait()
    finally:
        for proc in (first, second):
            proc.kill()
            proc.wait()


def test_the_learner_runs_a_rank_per_gpu_it_reserves(env, tmp_path) -> None:
    proc = start(env, tmp_path / "l", DAPO_LEARNER_GPU_IDS="0,1,2,3")
    proc.kill()
    proc.wait()
    assert (tmp_path / "l").read_text().split() == ["none", "4"]
    proc = start(env, tmp_path / "l2", DAPO_LEARNER_GPU_IDS="0,1", DAPO_LEARNER__LAUNCH__RANKS="1")
    proc.kill()
    proc.wait()
    assert (tmp_path / "l2").read_text().split() == ["none", "1"]


def test_compose_wires_the_learner_gpus_and_a_reset_that_frees_nothing() -> None:
    import yaml

    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    learner = services["learner"]
    devices = learner["deploy"]["resources"]["reservations"]["devices"][0]
    assert devices["device_ids"] == ["${LEARNER_GPU_IDS:-0}"]
    assert learner["environment"]["DAPO_LEARNER_GPU_IDS"] == "${LEARNER_GPU_IDS:-0}"
    assert services["gpu-slots-reset"]["entrypoint"] == ["dapo-entrypoint", "gpu-slots"]
