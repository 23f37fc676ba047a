"""Packed micro-batches equal padded ones: layout, log-probs and the DAPO gradient.

Random tiny Qwen2 models (fp32, temperature ≠ 1, chunked log-probs), the attention
implementations that keep packed sequences apart, and a spy on SDPA showing that
`sdpa_varlen` never attends across (or builds a mask over) the whole packed row.
"""

from __future__ import annotations

import os

import pytest
import torch
from learner_fixtures import make_groups
from test_learner_logprobs import TEMPERATURE, _cfg, tiny_qwen

from learner.attention import (
    VARLEN_SDPA,
    length_buckets,
    packed_attention,
    segment_bounds,
    varlen_sdpa_forward,
)
from learner.batch import (
    TrainSequence,
    assign_old_logprobs,
    collate,
    collate_packed,
    sequences_from_groups,
    use_packing,
)
from learner.batch_plan import packed_micro_batches, packs, token_budget_micro_batches
from learner.config import LearnerConfig, MaskedIS, SequenceTIS, TokenTIS
from learner.logprobs import sequence_logprobs
from learner.step import accumulate, recompute_old_logprobs
from learner.torch_policy import TorchPolicy

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def test_collate_packed_lays_sequences_end_to_end() -> None:
    seqs = [
        TrainSequence([1, 2], [3, 4, 5], [-0.1, -0.2, -0.3], advantage=0.5, truncated=False),
        TrainSequence([6], [7], [-0.4], advantage=-1.0, truncated=True),
    ]
    x = collate_packed(seqs, pad_token_id=0)
    x.check()
    assert x.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7]]
    assert x.position_ids is not None and x.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1]]
    assert x.response_mask.int().tolist() == [[0, 0, 1, 1, 1, 0, 1]]
    assert x.loss_mask.int().tolist() == [[0, 0, 1, 1, 1, 0, 0]]
    assert x.advantages.tolist() == [[0, 0, 0.5, 0.5, 0.5, 0, -1.0]]
    assert x.old_logprobs is not None
    torch.testing.assert_close(x.old_logprobs, torch.tensor([[0, 0, -0.1, -0.2, -0.3, 0, -0.4]]))
    assert x.starts.tolist() == [0, 5] and x.truncated.tolist() == [False, True]
    assert x.num_loss_tokens == 3 and x.attention_mask.all()
    assign_old_logprobs(seqs, x, torch.arange(7.0).unsqueeze(0))
    assert [s.old_logprobs.tolist() for s in seqs] == [[2.0, 3.0, 4.0], [6.0]]  # type: ignore[union-attr]
    assert segment_bounds(x.position_ids[0]) == [(0, 5), (5, 7)]


def _packed_by_sequence(seqs, overlong: bool):  # type: ignore[no-untyped-def]
    """The reference: the padded collate of each sequence alone, laid end to end."""
    parts = [collate([s], 0, overlong) for s in seqs]

    def cat(name: str):  # type: ignore[no-untyped-def]
        values = [getattr(p, name) for p in parts]
        return None if any(v is None for v in values) else torch.cat(values, dim=1)

    return {
        name: cat(name)
        for name in ("input_ids", "attention_mask", "response_mask", "loss_mask", "advantages")
        + ("old_logprobs", "rollout_logprobs", "ref_logprobs")
    }


@pytest.mark.parametrize("overlong", [True, False])
def test_batched_packing_equals_collating_each_sequence(overlong: bool) -> None:
    """Every field of the one-pass packed collate equals the per-sequence collate's."""
    seqs = sequences_from_groups(make_groups(seed=3))
    seqs[1].truncated = True
    seqs[2].old_logprobs = torch.linspace(-1, 0, len(seqs[2].response_ids))
    for s in seqs[3:]:
        s.old_logprobs = torch.full((len(s.response_ids),), -0.5)
    x = collate_packed(seqs, 0, overlong)
    x.check()
    for name, want in _packed_by_sequence(seqs, overlong).items():
        got = getattr(x, name)
        assert (got is None) == (want is None), name
        if want is not None:
            assert torch.equal(got, want), name
    assert x.truncated.tolist() == [s.truncated for s in seqs]
    assert x.response_lengths.tolist() == [len(s.response_ids) for s in seqs]
    lengths = [s.length for s in seqs]
    assert x.starts.tolist() == [sum(lengths[:i]) for i in range(len(seqs))]
    assert x.position_ids is not None
    assert x.position_ids.tolist() == [[t for n in lengths for t in range(n)]]
    seqs[0].rollout_logprobs = None  # one sequence without engine log-probs: no row
    assert collate_packed(seqs, 0).rollout_logprobs is None


@pytest.mark.parametrize(
    ("kw", "packed"),
    [
        ({}, True),
        ({"batching": {"packing": False}}, False),
        ({"objective": {"loss_agg_mode": "seq_mean_token_mean"}}, False),
        ({"objective": {"correction": TokenTIS()}}, True),
        ({"objective": {"correction": SequenceTIS()}}, False),
        ({"objective": {"correction": MaskedIS(level="token")}}, True),
        ({"objective": {"correction": MaskedIS()}}, True),
        ({"objective": {"correction": MaskedIS(level="sequence")}}, False),
    ],
)
def test_rows_are_packed_unless_the_loss_reduces_per_row(kw: dict, packed: bool) -> None:
    assert use_packing(LearnerConfig(**kw)) is packed


def test_auto_packing_packs_when_padding_costs_more_than_packing() -> None:
    """`packing: auto` by modelled cost per token: padded positions of the token-budget
    plan against real tokens × (1 + overhead); never where the loss reduces per row."""
    auto = LearnerConfig(batching={"packing": "auto", "micro_batch_tokens": 4096})
    uniform, skewed = [10] * 64, [10, 6] * 32  # no padding; 25 % of positions padded
    assert not packs(auto, uniform) and packs(auto, skewed)
    assert packs(auto, [100] + [60] * 8) and not packs(auto, [100] + [99] * 8)
    per_row = auto.model_copy(
        update={
            "objective": auto.objective.model_copy(update={"loss_agg_mode": "seq_mean_token_mean"})
        }
    )
    assert not packs(per_row, skewed)
    assert packs(LearnerConfig(), uniform)  # packing: true packs whatever the lengths
    assert not packs(LearnerConfig(batching={"packing": False}), skewed)
    with pytest.raises(ValueError, match="packing"):
        LearnerConfig(batching={"packing": "sometimes"})


def test_packed_micro_batches_fill_the_budget() -> None:
    lengths = [30, 5, 25, 12, 8, 40, 3, 17, 9, 60]
    bins = packed_micro_batches(lengths, max_tokens=40)
    assert sorted(i for b in bins for i in b) == list(range(10))
    assert all(sum(lengths[i] for i in b) <= 40 for b in bins if len(b) > 1)
    assert [9] in bins  # longer than the budget: alone
    assert len(bins) == 5 < len(token_budget_micro_batches(lengths, 40))  # 60 + ⌈149 / 40⌉
    split = packed_micro_batches([5] * 8, max_tokens=40, min_count=3)
    assert len(split) == 3 and sorted(i for b in split for i in b) == list(range(8))


def _padded_and_packed(impl: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    model = tiny_qwen(False)
    policy = TorchPolicy(model, _cfg(3, batching={"packing": False}))
    seqs = sequences_from_groups(make_groups(seed=1))
    with torch.no_grad():
        padded = collate(seqs, 0)
        assert (padded.attention_mask == 0).any()
        assign_old_logprobs(seqs, padded, sequence_logprobs(policy, padded, TEMPERATURE, 3)[0])
        want = [s.old_logprobs for s in seqs]
        model.set_attn_implementation(impl)
        packed = collate_packed(seqs, 0)
        assign_old_logprobs(seqs, packed, sequence_logprobs(policy, packed, TEMPERATURE, 3)[0])
    return [w for w in want if w is not None], [
        s.old_logprobs for s in seqs if s.old_logprobs is not None
    ]


@pytest.mark.parametrize("impl", [VARLEN_SDPA, "sdpa", "eager"])
def test_packed_logprobs_equal_padded_rows(impl: str) -> None:
    want, got = _padded_and_packed(impl)
    assert len(got) == len(want) == 16
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def _grads(packing: bool, checkpointing: bool) -> dict[str, torch.Tensor]:
    cfg = _cfg(4, batching={"packing": packing, "gradient_checkpointing": checkpointing})
    policy = TorchPolicy(tiny_qwen(False), cfg)
    seqs = sequences_from_groups(make_groups(seed=2))
    recompute_old_logprobs(policy, seqs, cfg, 0, TEMPERATURE)
    for s in seqs:  # move π_old off π_θ so the clip branches matter
        s.old_logprobs = s.old_logprobs - 0.1 * torch.arange(len(s.response_ids))
    accumulate(policy, seqs, cfg, 0, TEMPERATURE, 16)
    return {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("checkpointing", [False, True])
def test_packed_dapo_gradient_equals_padded(checkpointing: bool) -> None:
    want, got = _grads(False, False), _grads(True, checkpointing)
    assert got.keys() == want.keys()
    for name, grad in want.items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(got[name], grad, atol=1e-5, rtol=0, msg=name)


def test_varlen_attention_stays_within_each_sequence(monkeypatch: pytest.MonkeyPatch) -> None:
    """One SDPA call per length bucket and layer, none with a mask, each row one sequence."""
    calls: list[tuple[int, int, bool]] = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):  # type: ignore[no-untyped-def]
        calls.append((q.shape[0], q.shape[-2], attn_mask is None))
        return real(q, k, v, attn_mask=attn_mask, **kw)

    model = tiny_qwen(True)
    assert packed_attention(model, "cpu") == VARLEN_SDPA
    policy = TorchPolicy(model, _cfg(3))
    seqs = sequences_from_groups(make_groups(seed=4))
    packed = collate_packed(seqs, 0)
    assert packed.position_ids is not None
    buckets = length_buckets(segment_bounds(packed.position_ids[0]))
    assert 1 < len(buckets) < len(seqs)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    with torch.no_grad():
        sequence_logprobs(policy, packed, TEMPERATURE, 3)
    assert len(calls) == 2 * len(buckets)  # 2 layers × one call per bucket
    assert sum(rows for rows, _, _ in calls) == 2 * len(seqs)  # a row per sequence
    assert max(q for _, q, _ in calls) == max(s.length for s in seqs)
    assert all(no_mask for _, _, no_mask in calls)


def _per_sequence_attention(query, key, value, lengths):  # type: ignore[no-untyped-def]
    """The reference: causal SDPA on each sequence alone (what sdpa_varlen did before)."""
    outs, start = [], 0
    for n in lengths:
        q, k, v = (t[:, :, start : start + n] for t in (query, key, value))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=n > 1)
        outs.append(out.transpose(1, 2))
        start += n
    return torch.cat(outs, dim=1)


def test_bucketed_attention_equals_attention_per_sequence() -> None:
    """Values and gradients of the bucketed call = SDPA on each sequence alone (lengths
    1 to 40, several buckets), and a second row reuses no stale plan."""
    module = torch.nn.Module()
    gen = torch.Generator().manual_seed(0)
    for lengths in ([7, 1, 40, 3, 19, 20, 2, 33], [5, 5, 1]):
        total = sum(lengths)
        qkv = [torch.randn(1, 2, total, 8, generator=gen, requires_grad=True) for _ in range(3)]
        positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
        got, _ = varlen_sdpa_forward(module, *qkv, None, position_ids=positions)
        want = _per_sequence_attention(*qkv, lengths)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
        weights = torch.randn(want.shape, generator=gen)
        got_grads = torch.autograd.grad((got * weights).sum(), qkv)
        want_grads = torch.autograd.grad((want * weights).sum(), qkv)
        for a, b in zip(got_grads, want_grads, strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
