"""Chunked log-probs equal the full-logits path and never hold more than a chunk of logits.

Random tiny Qwen2 models (tied and untied heads) built locally, fp32, temperature ≠ 1,
right-padded micro-batches of mixed lengths.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from learner_fixtures import make_groups
from transformers import Qwen2ForCausalLM

from benchmarks._models import random_qwen2
from learner.algorithm import token_logprobs
from learner.batch import collate, sequences_from_groups
from learner.config import LearnerConfig
from learner.init_model import ModelShape
from learner.logprobs import head_logprobs, sequence_logprobs
from learner.step import accumulate, recompute_old_logprobs
from learner.torch_policy import TorchPolicy
from services.common.config_loader import deep_merge

os.environ.setdefault("DS_ACCELERATOR", "cpu")
VOCAB, TEMPERATURE = 257, 0.7


def tiny_qwen(tied: bool, seed: int = 0) -> Qwen2ForCausalLM:
    model = random_qwen2(VOCAB, ModelShape(32, 64, 2, 4, 2, 64, tied), seed)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    return model


def _cfg(chunk: int, **sections: object) -> LearnerConfig:
    base = {
        "engine": "torch",
        "dtype": "float32",
        "optimizer": {"lr": 1e-3},
        "batching": {
            "gradient_checkpointing": False,
            "micro_batch_tokens": 40,
            "logprob_chunk_tokens": chunk,
        },
    }
    return LearnerConfig.model_validate(deep_merge(base, sections))


def test_token_logprobs_of_head_rows_equal_log_softmax_and_have_its_gradient() -> None:
    """The `[N, V]` rows the chunked head scores: log-probs and entropy as log_softmax says."""
    torch.manual_seed(0)
    logits = torch.randn(6, 11, dtype=torch.float64) * 3
    targets = torch.randint(0, 11, (6,))
    lp, ent = token_logprobs(logits, targets, TEMPERATURE)
    log_p = torch.log_softmax(logits / TEMPERATURE, dim=-1)
    torch.testing.assert_close(lp, log_p[torch.arange(6), targets])
    torch.testing.assert_close(ent, -(log_p.exp() * log_p).sum(dim=-1))
    x = logits.clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda z: token_logprobs(z, targets, TEMPERATURE)[0], (x,))
    bf16 = logits.to(torch.bfloat16)
    assert token_logprobs(bf16, targets, 1.0)[0].dtype == torch.float32
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(logits, targets, 0.0)


def test_head_logprobs_runs_at_least_min_chunks_calls() -> None:
    head, calls = torch.nn.Linear(4, 9, bias=False), []
    head.register_forward_hook(lambda m, i, o: calls.append(o.shape[0]))
    hidden, targets = torch.randn(5, 4), torch.randint(0, 9, (5,))
    with torch.no_grad():
        a = head_logprobs(hidden, head, targets, 1.0, chunk=2)
        assert calls == [2, 2, 1]
        b = head_logprobs(hidden, head, targets, 1.0, chunk=2, min_chunks=7)
    assert calls[3:] == [1, 1, 1, 1, 1, 0, 0]  # a ZeRO-3 rank with fewer tokens
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize("tied", [True, False])
def test_chunked_logprobs_and_entropy_equal_the_full_logits(tied: bool) -> None:
    policy = TorchPolicy(tiny_qwen(tied), _cfg(0))
    inputs = collate(sequences_from_groups(make_groups(seed=1)), pad_token_id=0)
    assert (inputs.attention_mask == 0).any()  # padded rows
    with torch.no_grad():
        full_lp, full_ent = sequence_logprobs(policy, inputs, TEMPERATURE, chunk=0)
        for chunk in (1, 3, 1000):
            lp, ent = sequence_logprobs(policy, inputs, TEMPERATURE, chunk)
            m = inputs.response_mask
            torch.testing.assert_close(lp[m], full_lp[m], atol=1e-5, rtol=0)
            torch.testing.assert_close(ent[m], full_ent[m], atol=1e-5, rtol=0)
            assert (lp[~m] == 0).all() and (ent[~m] == 0).all()
            assert ent[m].min() > 0


def _dapo_grads(model: Qwen2ForCausalLM, cfg: LearnerConfig) -> dict[str, torch.Tensor]:
    """π_old recompute (shifted so the clip branches matter), then one mini-batch."""
    policy = TorchPolicy(model, cfg)
    seqs = sequences_from_groups(make_groups(seed=2))
    recompute_old_logprobs(policy, seqs, cfg, 0, TEMPERATURE)
    for s in seqs:
        s.old_logprobs = s.old_logprobs - 0.1 * torch.arange(len(s.response_ids))
    accumulate(policy, seqs, cfg, 0, TEMPERATURE, 16)
    return {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("tied", [True, False])
def test_chunked_dapo_gradient_equals_the_full_logits(tied: bool) -> None:
    want = _dapo_grads(tiny_qwen(tied), _cfg(0))
    for chunk in (1, 4):
        got = _dapo_grads(tiny_qwen(tied), _cfg(chunk))
        assert got.keys() == want.keys()
        for name, grad in want.items():
            assert grad.abs().max() > 0, name
            torch.testing.assert_close(got[name], grad, atol=1e-5, rtol=0, msg=name)


class LogitsWatch:
    """Rows of full-vocabulary tensors: made by the head, and saved for backward."""

    def __init__(self, model: torch.nn.Module, head: torch.nn.Module) -> None:
        self.head_rows: list[int] = []
        self.saved_rows = 0
        self.weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        head.register_forward_hook(lambda m, i, o: self.head_rows.append(o.numel() // VOCAB))

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        is_weight = t.untyped_storage().data_ptr() in self.weights  # e.g. the head's Wᵀ
        if t.dim() >= 2 and t.shape[-1] == VOCAB and not is_weight:
            self.saved_rows = max(self.saved_rows, t.numel() // VOCAB)
        return t


def _watch_step(chunk: int) -> tuple[LogitsWatch, int]:
    cfg = _cfg(
        chunk, batching={"micro_batch_tokens": 10_000}
    )  # one micro-batch: B·L rows on the full path
    policy = TorchPolicy(tiny_qwen(False), cfg)
    seqs = sequences_from_groups(make_groups(seed=3))
    recompute_old_logprobs(policy, seqs, cfg, 0, TEMPERATURE)
    watch = LogitsWatch(policy.model, policy.lm_head)
    with torch.autograd.graph.saved_tensors_hooks(watch.pack, lambda t: t):
        accumulate(policy, seqs, cfg, 0, TEMPERATURE, 16)
    return watch, sum(len(s.response_ids) for s in seqs)


def test_at_most_one_chunk_of_logits_exists_in_forward_and_backward() -> None:
    watch, tokens = _watch_step(chunk=4)
    assert max(watch.head_rows) <= 4 and watch.saved_rows <= 4
    # Every response token's logits are made twice: in forward, and again in backward
    # (recomputed one chunk at a time, not kept).
    assert sum(watch.head_rows) == 2 * tokens
    full, _ = _watch_step(chunk=0)  # the baseline breaks both bounds
    assert max(full.head_rows) > 4 * 10 and full.saved_rows > 4 * 10


@pytest.mark.parametrize(("zero_stage", "checkpointing"), [(0, False), (3, True)])
def test_deepspeed_chunked_untied_gradient_equals_torch_full(
    tmp_path: Path, zero_stage: int, checkpointing: bool
) -> None:
    """ZeRO-3 partitions the head's weight: the chunks call the head as a module."""
    from learner.deepspeed_policy import DeepSpeedPolicy

    tiny_qwen(False).save_pretrained(tmp_path)
    want = _dapo_grads(Qwen2ForCausalLM.from_pretrained(tmp_path), _cfg(0))
    cfg = _cfg(
        3,
        engine="deepspeed",
        deepspeed={"zero_stage": zero_stage},
        batching={"gradient_checkpointing": checkpointing},
    )
    policy = DeepSpeedPolicy(Qwen2ForCausalLM.from_pretrained(tmp_path), cfg)
    seqs = sequences_from_groups(make_groups(seed=2))
    recompute_old_logprobs(policy, seqs, cfg, 0, TEMPERATURE)
    for s in seqs:
        s.old_logprobs = s.old_logprobs - 0.1 * torch.arange(len(s.response_ids))
    accumulate(policy, seqs, cfg, 0, TEMPERATURE, 16)
    got = policy.full_gradients()
    assert got.keys() == want.keys()
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, atol=1e-5, rtol=0, msg=name)
