"""Groups to tensors, mini/micro-batching, and exactness of the token-level loss across them."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from learner.algorithm import agg_loss, policy_loss
from learner.batch import (
    LossInputs,
    TrainSequence,
    assign_old_logprobs,
    collate,
    collate_packed,
    loss_counts,
    sequences_from_groups,
)
from learner.batch_plan import (
    balance_across_ranks,
    fixed_size_micro_batches,
    mini_batches,
    packed_micro_batches,
    padding_fraction,
    token_budget_micro_batches,
)
from learner.logprobs import logprobs_for_inputs
from services.common.types import Group, Sample

PAD = 0


def _sample(tokens: list[int], reward: float, finish: str = "stop", lp: bool = True) -> Sample:
    logprobs = [-0.1 * (k + 1) for k in range(len(tokens))] if lp else []
    return Sample(tokens, logprobs, "", finish, policy_version=3, reward=reward)  # type: ignore[arg-type]


def _group(gid: str, prompt: list[int], samples: list[Sample]) -> Group:
    return Group(gid, "p" + gid, "", prompt, "", samples=samples)


def test_sequences_from_groups_advantages_and_truncation() -> None:
    groups = [
        _group("a", [5, 6], [_sample([1, 2, 3], 1.0), _sample([4], -1.0, "length")]),
        _group("b", [7], [_sample([8], 1.0), _sample([9, 9], 1.0, "abort")]),
    ]
    seqs = sequences_from_groups(groups, adv_epsilon=0.0)
    s2 = 2**0.5  # unbiased std of {1, -1}
    assert [s.advantage for s in seqs] == pytest.approx([1 / s2, -1 / s2, 0.0, 0.0])
    assert [s.truncated for s in seqs] == [False, True, False, True]
    assert [s.length for s in seqs] == [5, 3, 2, 3]
    assert seqs[0].rollout_logprobs == pytest.approx([-0.1, -0.2, -0.3])
    assert seqs[0].group_id == "a" and seqs[0].policy_version == 3
    raw = sequences_from_groups(groups[:1], adv_epsilon=0.0, norm_adv_by_std=False)
    assert [s.advantage for s in raw] == [1.0, -1.0]


def test_sequences_from_groups_rejects_bad_inputs() -> None:
    bad_lp = Sample([1, 2], [-0.5], "", "stop", 0)
    with pytest.raises(ValueError, match="1 log-probs for 2"):
        sequences_from_groups([_group("x", [1], [bad_lp, _sample([3], 0.0)])])
    with pytest.raises(ValueError, match="empty prompt"):
        sequences_from_groups([_group("y", [], [_sample([3], 0.0)])])


def test_collate_layout_is_exact() -> None:
    seqs = [
        TrainSequence([1, 2], [3, 4, 5], [-0.1, -0.2, -0.3], advantage=0.5, truncated=False),
        TrainSequence([6], [7], [-0.4], advantage=-1.0, truncated=True),
    ]
    x = collate(seqs, pad_token_id=PAD)
    x.check()
    assert x.input_ids.tolist() == [[1, 2, 3, 4, 5], [6, 7, 0, 0, 0]]
    assert x.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert x.response_mask.int().tolist() == [[0, 0, 1, 1, 1], [0, 1, 0, 0, 0]]
    assert x.loss_mask.int().tolist() == [[0, 0, 1, 1, 1], [0, 0, 0, 0, 0]]
    assert x.advantages.tolist() == [[0, 0, 0.5, 0.5, 0.5], [0, -1.0, 0, 0, 0]]
    assert x.old_logprobs is not None and x.rollout_logprobs is not None
    expected_lp = torch.tensor([[0, 0, -0.1, -0.2, -0.3], [0, -0.4, 0, 0, 0]])
    torch.testing.assert_close(x.old_logprobs, expected_lp)
    torch.testing.assert_close(x.rollout_logprobs, expected_lp)
    assert x.truncated.tolist() == [False, True] and x.response_lengths.tolist() == [3, 1]
    assert x.num_loss_tokens == 3
    unfiltered = collate(seqs, PAD, overlong_filtering=False)
    assert unfiltered.num_loss_tokens == 4 and torch.equal(unfiltered.loss_mask, x.response_mask)


def test_collate_without_logprobs_and_shape_check() -> None:
    seqs = [TrainSequence([1], [2], None, 1.0, False), TrainSequence([1], [2], [-1.0], 1.0, False)]
    x = collate(seqs, PAD)
    assert x.old_logprobs is None and x.rollout_logprobs is None
    seqs[0].old_logprobs = torch.tensor([-2.0])
    y = collate(seqs, PAD)
    assert y.old_logprobs is not None and y.old_logprobs[:, 1].tolist() == [-2.0, -1.0]
    assert y.rollout_logprobs is None
    y.advantages = y.advantages.double()
    with pytest.raises(ValueError, match="advantages"):
        y.check()
    with pytest.raises(ValueError, match="at least one"):
        collate([], PAD)
    assert isinstance(x.to("cpu"), LossInputs)


class TinyCausalLM(nn.Module):
    """Causal by construction: position t sees the running mean of embeddings up to t.

    With `position_ids` (packed rows) the running mean restarts at each position 0.
    """

    def __init__(self, vocab: int = 13, dim: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None):
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1]).expand_as(input_ids)
        total = self.emb(input_ids).cumsum(dim=1)
        first = torch.cummax(
            torch.where(position_ids == 0, torch.arange(input_ids.shape[1]), 0), dim=1
        ).values
        before = torch.cat([torch.zeros_like(total[:, :1]), total[:, :-1]], dim=1)
        h = total - before.gather(1, first.unsqueeze(-1).expand_as(total))
        h = h / (position_ids + 1).to(h.dtype).unsqueeze(-1)
        return self.head(torch.tanh(h))


def _random_groups(seed: int, n_groups: int, g: int, max_len: int) -> list[Group]:
    rng = random.Random(seed)
    groups = []
    for k in range(n_groups):
        prompt = [rng.randrange(1, 13) for _ in range(rng.randint(1, 4))]
        samples = []
        for _ in range(g):
            n = rng.choice([1, 2, max_len]) if rng.random() < 0.5 else rng.randint(1, max_len)
            finish = "length" if n == max_len else "stop"
            samples.append(_sample([rng.randrange(1, 13) for _ in range(n)], rng.random(), finish))
        groups.append(_group(str(k), prompt, samples))
    return groups


def _step_loss(
    model: nn.Module, seqs: list[TrainSequence], micro: list[list[int]], counts, packed=False
):
    """Sum of micro-batch token_mean losses over the given global count; grads accumulate."""
    model.zero_grad()
    total = 0.0
    for idx in micro:
        x = (collate_packed if packed else collate)([seqs[i] for i in idx], PAD)
        assert x.old_logprobs is not None
        logits = model(x.input_ids, x.position_ids)
        lp, _ = logprobs_for_inputs(logits, x.input_ids, temperature=0.9)
        adv, old = x.advantages.double(), x.old_logprobs.double()
        loss_mat, _ = policy_loss(lp, old, adv, x.loss_mask, 0.2, 0.28, clip_ratio_c=10.0)
        loss = agg_loss(loss_mat, x.loss_mask, "token_mean", global_token_count=counts)
        loss.backward()
        total += loss.item()
    return total, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("packed", [False, True])
def test_token_budget_micro_batches_give_the_full_batch_loss_and_gradient(packed: bool) -> None:
    """Padded or packed micro-batches = the whole batch in one padded micro-batch."""
    torch.manual_seed(0)
    model = TinyCausalLM().double()
    seqs = sequences_from_groups(_random_groups(1, n_groups=4, g=4, max_len=12))
    assert any(s.truncated for s in seqs)
    tokens = loss_counts(seqs).tokens
    full_loss, full_grads = _step_loss(model, seqs, [list(range(len(seqs)))], None)
    split = packed_micro_batches if packed else token_budget_micro_batches
    micro = split([s.length for s in seqs], max_tokens=24 if packed else 40)
    assert len(micro) > 3 and (not packed or max(len(m) for m in micro) > 2)
    micro_loss, micro_grads = _step_loss(model, seqs, micro, tokens, packed)
    assert micro_loss == pytest.approx(full_loss, rel=1e-12)
    for a, b in zip(micro_grads, full_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert any(g.abs().sum() > 0 for g in full_grads)


def test_recomputed_old_logprobs_round_trip_and_make_ratio_one() -> None:
    torch.manual_seed(0)
    model = TinyCausalLM().double()
    seqs = sequences_from_groups(_random_groups(2, n_groups=2, g=4, max_len=6))
    for idx in token_budget_micro_batches([s.length for s in seqs], max_tokens=20):
        part = [seqs[i] for i in idx]
        x = collate(part, PAD)
        with torch.no_grad():
            lp, _ = logprobs_for_inputs(model(x.input_ids), x.input_ids)
        assign_old_logprobs(part, x, lp)
    assert all(s.old_logprobs is not None for s in seqs)
    assert [len(s.old_logprobs) for s in seqs] == [len(s.response_ids) for s in seqs]  # type: ignore[arg-type]
    x = collate(seqs, PAD)
    lp, _ = logprobs_for_inputs(model(x.input_ids), x.input_ids)
    assert x.old_logprobs is not None
    torch.testing.assert_close(lp.float() * x.response_mask, x.old_logprobs, rtol=0, atol=1e-6)
    # Alignment: the log-prob at a response position is that of input_ids[t] given logits[t-1].
    b, t = 0, len(seqs[0].prompt_ids)
    logits = model(x.input_ids)
    direct = torch.log_softmax(logits[b, t - 1], -1)[x.input_ids[b, t]]
    assert lp[b, t].item() == pytest.approx(direct.item())


def test_loss_counts() -> None:
    seqs = [
        TrainSequence([1], [2, 3, 4], None, 1.0, False),
        TrainSequence([1], [2, 3], None, 1.0, True),
        TrainSequence([1], [], None, 1.0, False),
    ]
    assert loss_counts(seqs) == (3, 1)
    assert loss_counts(seqs, overlong_filtering=False) == (5, 2)


def test_mini_batches_cover_once_and_are_deterministic() -> None:
    assert mini_batches(5, 2) == [[0, 1], [2, 3], [4]]
    a, b = mini_batches(100, 32, seed=7), mini_batches(100, 32, seed=7)
    assert a == b and [len(m) for m in a] == [32, 32, 32, 4]
    assert sorted(i for m in a for i in m) == list(range(100))
    assert a != mini_batches(100, 32, seed=8)
    with pytest.raises(ValueError):
        mini_batches(4, 0)


def _skewed_lengths(n: int, seed: int) -> list[int]:
    """Most responses short, a fifth very long: what reasoning rollouts look like."""
    rng = random.Random(seed)
    return [
        rng.randint(2000, 8000) if rng.random() < 0.2 else rng.randint(50, 600) for _ in range(n)
    ]


def test_token_budget_keeps_padding_low_on_skewed_batch() -> None:
    lengths = _skewed_lengths(512, seed=0)
    budget = 32768
    micro = token_budget_micro_batches(lengths, budget)
    assert sorted(i for m in micro for i in m) == list(range(512))
    assert all(len(m) * max(lengths[i] for i in m) <= budget for m in micro)
    smart = padding_fraction(lengths, micro)
    naive = padding_fraction(lengths, fixed_size_micro_batches(512, 8))
    assert smart <= 0.10, smart
    assert naive >= 0.5, naive
    # About as many forwards as the naive split, not one per row.
    assert len(micro) <= len(fixed_size_micro_batches(512, 8))


def test_token_budget_edge_cases() -> None:
    assert token_budget_micro_batches([50, 10, 10], max_tokens=20) == [[0], [1, 2]]
    assert token_budget_micro_batches([], max_tokens=20) == []
    split = token_budget_micro_batches([5] * 8, max_tokens=40, min_count=3)
    assert len(split) == 3 and sorted(i for m in split for i in m) == list(range(8))
    assert len(token_budget_micro_batches([5, 5], max_tokens=40, min_count=5)) == 2
    assert padding_fraction([4, 2], [[0, 1]]) == 0.25
    assert padding_fraction([], []) == 0.0


def test_balance_across_ranks_equalises_tokens() -> None:
    lengths = _skewed_lengths(256, seed=1)
    ranks = balance_across_ranks(lengths, world_size=4)
    assert sorted(i for r in ranks for i in r) == list(range(256))
    totals = [sum(lengths[i] for i in r) for r in ranks]
    assert max(totals) - min(totals) <= max(lengths)
