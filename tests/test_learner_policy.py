"""The policy back ends: no import cycle, one process for plain torch, checkpointing exact."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from learner_fixtures import make_groups

from learner.backends import build_policy
from learner.batch import sequences_from_groups
from learner.config import BatchingConfig, LearnerConfig
from learner.dist import Single
from learner.model_io import load_model
from learner.step import accumulate, recompute_old_logprobs
from learner.torch_policy import TorchPolicy
from services.common.errors import DapoError

ROOT = Path(__file__).resolve().parents[1]


def test_back_ends_do_not_import_the_policy_module() -> None:
    """The protocol module imports the back ends, never the other way round."""
    code = (
        "import sys, learner.torch_policy, learner.deepspeed_policy, learner.reference; "
        "print(sorted(m for m in sys.modules if m.startswith('learner.')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": f"{ROOT}:{ROOT / 'proto'}", "PATH": "/usr/bin:/bin"},
    ).stdout
    assert "learner.torch_policy" in out and "'learner.policy'" not in out, out


def test_torch_engine_refuses_several_ranks_with_a_clear_error(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(DapoError, match="learner.engine=deepspeed"):
        build_policy(tiny_model, LearnerConfig(engine="torch", dtype="float32"))


def test_a_follower_without_torch_distributed_gets_a_clear_error() -> None:
    assert Single().broadcast_bytes(b"x") == b"x"
    with pytest.raises(DapoError, match="deepspeed"):
        Single().broadcast_bytes(None)


def _grads(model_dir: Path, checkpointing: bool) -> dict[str, torch.Tensor]:
    cfg = LearnerConfig(
        engine="torch",
        dtype="float32",
        batching=BatchingConfig(
            gradient_checkpointing=checkpointing, micro_batch_tokens=40, logprob_chunk_tokens=3
        ),
    )
    torch.manual_seed(0)
    policy = TorchPolicy(load_model(model_dir), cfg)
    assert policy.model.is_activation_checkpointing == checkpointing
    seqs = sequences_from_groups(make_groups(seed=5))
    recompute_old_logprobs(policy, seqs, cfg, 0, 0.7)
    for s in seqs:  # move π_old off π_θ so the clip branches matter
        s.old_logprobs = s.old_logprobs - 0.05 * torch.arange(len(s.response_ids))
    accumulate(policy, seqs, cfg, 0, 0.7, 16)
    return {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None}


def test_gradient_checkpointing_gives_the_same_gradients(tiny_model: Path) -> None:
    on, off = _grads(tiny_model, True), _grads(tiny_model, False)
    assert on.keys() == off.keys() and len(on) > 5
    for name, grad in off.items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(on[name], grad, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("tied", [True, False])
def test_published_weights_hold_a_tied_tensor_once(tiny_model: Path, tied: bool) -> None:
    """A tied LM head is the embedding under a second name: published once (the rollout
    engines cover the tie), every other weight published, `weight_count` exact."""
    model = load_model(tiny_model)
    if not tied:
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    policy = TorchPolicy(model, LearnerConfig(dtype="float32"))
    published = dict(policy.named_weights())
    everything = model.state_dict()
    assert len(published) == policy.weight_count()
    assert ("lm_head.weight" in published) is not tied
    assert set(everything) - set(published) == ({"lm_head.weight"} if tied else set())
    assert all(torch.equal(published[n], everything[n]) for n in published)
    storages = {t.untyped_storage().data_ptr() for t in published.values()}
    assert len(storages) == len(published)
