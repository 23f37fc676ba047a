"""Every device decided once (issue 35), each decision checked without a GPU: the
data-parallel group's tensors follow its backend, `learner.device` becomes one device
per rank, DeepSpeed refuses a `learner.device` it cannot honour, and `dapo up` hands
each learner rank and rollout server its own GPU(s) when the host has enough."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from learner.config import LearnerConfig
from learner.deepspeed_policy import device_mismatch, group_backend
from learner.dist import backend_device, learner_device
from services.common.errors import DapoError
from services.tools.config import load_config
from services.tools.gpus import assign_gpus, host_gpus, launch_gpus


@pytest.mark.parametrize(
    ("backend", "rank", "device"),
    [
        ("nccl", 3, torch.device("cuda", 3)),
        ("gloo", 3, torch.device("cpu")),
        ("cpu:gloo,cuda:nccl", 1, torch.device("cuda", 1)),  # init_process_group(None)
        ("mpi", 0, torch.device("cpu")),
    ],
)
def test_the_groups_tensors_follow_its_backend(backend, rank, device) -> None:
    assert backend_device(backend, rank) == device


def test_deepspeeds_group_backend_follows_its_accelerator() -> None:
    assert group_backend("cuda") == "nccl" and group_backend("cpu") == "gloo"
    assert backend_device(group_backend("cuda"), 2) == torch.device("cuda", 2)


@pytest.mark.parametrize(
    ("setting", "cuda", "rank", "device"),
    [
        ("auto", True, 2, torch.device("cuda", 2)),
        ("auto", False, 2, torch.device("cpu")),
        ("cuda", True, 1, torch.device("cuda", 1)),
        ("cuda:5", True, 1, torch.device("cuda", 5)),
        ("cpu", True, 0, torch.device("cpu")),
    ],
)
def test_learner_device_is_one_device_per_rank(setting, cuda, rank, device) -> None:
    assert learner_device(setting, cuda, rank) == device


def test_a_cuda_learner_device_without_cuda_is_an_error() -> None:
    with pytest.raises(DapoError, match="learner.device=cuda, but CUDA is not available"):
        learner_device("cuda", False, 0)


def test_learner_device_is_a_setting_defaulting_to_auto() -> None:
    assert LearnerConfig().device == "auto"
    assert LearnerConfig(device="cuda:1").device == "cuda:1"
    with pytest.raises(ValidationError):
        LearnerConfig(device="gpu")


def test_deepspeed_refuses_a_device_it_cannot_honour() -> None:
    assert device_mismatch("auto", "cuda") is None and device_mismatch("cuda:0", "cuda") is None
    assert device_mismatch("cpu", "cpu") is None
    assert "DS_ACCELERATOR=cpu" in (device_mismatch("cpu", "cuda") or "")
    assert "learner.device=cuda" in (device_mismatch("cuda", "cpu") or "")


GPUS8 = [str(i) for i in range(8)]


@pytest.mark.parametrize(
    ("gpus", "ranks", "rollouts", "tp", "plan"),
    [
        ([], 1, 2, 1, {}),  # no GPU: nothing set, everything on CPU
        (["0"], 1, 1, 1, {"learner": "0", "rollout": "0"}),  # one GPU: all share it
        (["0"], 1, 2, 1, {"learner": "0", "rollout-0": "0", "rollout-1": "0"}),
        (["0", "1"], 1, 1, 1, {"learner": "0", "rollout": "1"}),
        (
            GPUS8, 1, 7, 1,
            {"learner": "0", **{f"rollout-{i}": str(i + 1) for i in range(7)}},
        ),
        (
            GPUS8, 4, 2, 2,
            {"learner": "0,1,2,3", "rollout-0": "4,5", "rollout-1": "6,7"},
        ),
        (
            ["4", "6"], 1, 3, 1,
            {"learner": "4", "rollout-0": "6", "rollout-1": "4", "rollout-2": "6"},
        ),
    ],
)  # fmt: skip
def test_each_process_gets_its_own_gpus_when_there_are_enough(
    gpus, ranks, rollouts, tp, plan
) -> None:
    assert assign_gpus(gpus, ranks, rollouts, tp) == plan


def test_no_rank_and_no_server_gets_one_gpu_twice() -> None:
    for gpus in (["0"], ["0", "1", "2"], GPUS8):
        for tp in range(1, len(gpus) + 1):
            for ids in assign_gpus(gpus, len(gpus), 5, tp).values():
                assert len(set(ids.split(","))) == len(ids.split(","))
    with pytest.raises(DapoError, match="tensor_parallel_size=2 needs as many GPUs"):
        assign_gpus(["0"], 1, 1, 2)
    with pytest.raises(DapoError, match="learner.launch.ranks=3 needs as many GPUs"):
        assign_gpus(["0", "1"], 3, 1, 1)


def test_host_gpus_from_cuda_visible_devices_or_the_driver(tmp_path: Path) -> None:
    assert host_gpus({"CUDA_VISIBLE_DEVICES": "2,3"}, tmp_path) == ["2", "3"]
    assert host_gpus({"CUDA_VISIBLE_DEVICES": ""}, tmp_path) == []
    assert host_gpus({"CUDA_VISIBLE_DEVICES": "-1"}, tmp_path) == []
    assert host_gpus({}, tmp_path / "absent") == []
    for bus in ("0000:17:00.0", "0000:65:00.0"):
        (tmp_path / bus).mkdir()
    assert host_gpus({}, tmp_path) == ["0", "1"]


def test_dapo_ups_plan_reads_the_run_config(monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    config = load_config(
        overrides=["rollout.engine.kind=vllm", "rollout.engine.tensor_parallel_size=2"]
    )
    assert launch_gpus(config, 1) == {"learner": "0", "rollout": "1,2"}
    config = load_config(preset="tiny")  # the torch engine: one GPU a server
    assert launch_gpus(config, 3) == {
        "learner": "0", "rollout-0": "1", "rollout-1": "2", "rollout-2": "3"
    }  # fmt: skip
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert launch_gpus(config, 3) == {}
