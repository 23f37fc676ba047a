"""`learner.device` is honoured (issue 35): the torch policy and the KL reference model
are built where it says, the reference on the policy's device, and a device this machine
or DeepSpeed cannot give is a clear error before any training. On a CPU machine the
placements checked are the CPU's; the decisions themselves: tests/test_devices.py."""

from __future__ import annotations

import pytest
import torch
from learner_fixtures import learner_config

from learner.backends import build_policy
from learner.config import LearnerConfig
from learner.trainer import Trainer
from services.common.errors import DapoError

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")


def devices(module: torch.nn.Module) -> set[torch.device]:
    return {p.device for p in module.parameters()}


def test_the_trainer_puts_policy_and_reference_on_learner_device(tiny_model) -> None:
    sets = {
        "learner.engine": "torch",
        "learner.dtype": "float32",
        "learner.device": "cpu",
        "learner.objective.kl_coef": 0.1,
    }
    trainer = Trainer(learner_config(tiny_model, "dev", sets))
    assert trainer.policy.device == torch.device("cpu")
    assert devices(trainer.policy.module) == {torch.device("cpu")}
    assert trainer.reference is not None
    assert devices(trainer.reference.model) == {trainer.policy.device}


@NO_CUDA
def test_a_cuda_device_without_cuda_stops_the_torch_policy(tiny_model) -> None:
    cfg = LearnerConfig(engine="torch", dtype="float32", device="cuda")
    with pytest.raises(DapoError, match="learner.device=cuda, but CUDA is not available"):
        build_policy(tiny_model, cfg)


@NO_CUDA
def test_deepspeed_refuses_a_device_its_accelerator_is_not(tiny_model) -> None:
    cfg = LearnerConfig(engine="deepspeed", device="cuda:0")
    with pytest.raises(DapoError, match="DeepSpeed's accelerator here is cpu"):
        build_policy(tiny_model, cfg)
