"""The torch engine's checkpoints: safetensors + JSON, no pickle, exact round trip."""

from __future__ import annotations

from pathlib import Path

import torch

from learner.model_io import load_model
from learner.torch_policy import TorchPolicy
from services.tools.config import load_config


def trained_policy(model_dir: Path) -> TorchPolicy:
    cfg = load_config(preset="tiny", env={}).learner
    policy = TorchPolicy(load_model(model_dir), cfg)
    ids = torch.randint(1, 14, (4, 6))
    loss = policy.lm_head(policy.hidden_states(ids, torch.ones_like(ids))).logsumexp(-1).mean()
    policy.backward(loss)
    policy.step()
    policy.advance_schedule()
    return policy


def test_checkpoint_round_trips_model_optimizer_and_schedule(
    tmp_path: Path, tiny_model: Path
) -> None:
    policy = trained_policy(tiny_model)
    policy.save_checkpoint(tmp_path, "step1", {"step": 1, "cursor": "5-0"})
    assert not list(tmp_path.rglob("*.pt"))  # nothing pickled
    fresh = TorchPolicy(load_model(tiny_model), policy.cfg)
    assert fresh.load_checkpoint(tmp_path) == {"step": 1, "cursor": "5-0"}
    for (name, a), (_, b) in zip(policy.named_weights(), fresh.named_weights(), strict=True):
        assert torch.equal(a, b), name
    old, new = policy.optimizer.state_dict(), fresh.optimizer.state_dict()
    for key, state in old["state"].items():
        for field, value in state.items():
            assert torch.equal(value, new["state"][key][field]), (key, field)
    assert fresh.scheduler.state_dict()["last_epoch"] == policy.scheduler.state_dict()["last_epoch"]
