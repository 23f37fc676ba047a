"""scripts/gpu_check.sh in its CPU mode, so the GPU check cannot rot between GPU runs:
`dapo up --preset tiny` with the DeepSpeed learner (ZeRO-2) to the end with its ledger
and held-out accuracy before and after (part a), the torch engine and DeepSpeed learner
steps as `dapo learner` builds the policy (c), and the weight path against a raw copy (d).
Part b (two rollout servers) is part a's `dapo_up` with --rollouts 2; it is left out here
to keep the test short (about 60 s more on 2 cores)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(420)
def test_gpu_check_runs_dapo_up_first_in_its_cpu_mode(tmp_path: Path) -> None:
    # Two GPU ids on a machine without CUDA: dapo up hands them out (the learner one, the
    # rollout server the other) and every process still runs on the CPU.
    env = {**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": "0,1"}
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--device", "cpu", "--steps", "1",
         "--parts", "acd", "--out", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    figures = json.loads((tmp_path / "gpu_check.json").read_text())
    assert figures["status"] == "done" and figures["device"] == "cpu"
    assert list(k for k in figures if k.endswith("_wall_s")) == [
        "a_up_wall_s", "c_engine_learner_wall_s", "d_weight_path_wall_s"
    ]  # fmt: skip
    up = figures["a_up"]
    assert up["exit_code"] == 0 and up["steps"] == 1 and up["ledger_ok"]
    assert up["visible_gpus"] == {"learner": ["0"], "rollout": ["1"]}
    assert up["eval_before"]["version"] == 0 and up["eval_after"]["version"] == 1
    steps = figures["c_engine_learner"]["learner_steps"]
    assert [r["engine"] for r in steps] == ["DeepSpeedPolicy"] * 2
    assert figures["c_engine_learner"]["generation"]["logprobs_ok"]
    weights = figures["d_weight_path"]
    assert weights["seconds_per_version"] > 0 and weights["raw_h2d"]["seconds"] > 0
    assert "gpu_check: a_up:" in (tmp_path / "gpu_check.log").read_text()
