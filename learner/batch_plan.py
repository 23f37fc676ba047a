"""How a step's sequences are cut: mini-batches, rank shares and micro-batches.

`plan_step` splits the responses into mini-batches (one optimizer step each, the same
seeded split on every rank) and deals each to the data-parallel ranks with token totals
balanced; `plan_micro_batches` cuts a rank's share by token budget, into rows to pad
(sorted by length, which keeps padding low) or bins to pack, with dummy forwards so
every rank runs the same count; `global_counts` sums what the loss is divided by over
the ranks. The cutting itself is pure functions of the row lengths (no tensors), so the
plan is cheap, testable and the same on every rank. What a batch is: `learner.batch`.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import torch

from learner.batch import LossCounts, TrainSequence, loss_counts, use_packing
from learner.config import LearnerConfig
from learner.dist import DataParallel

# A packed row costs this much more per token than a padded row without padding (the
# gathers of bucketed attention; measured on CPU, tiny Qwen2, 128 rows of 10-120 tokens:
# 6-10 %), so `packing: auto` packs only when padding would waste more than that.
PACKING_OVERHEAD = 0.08


def packs(cfg: LearnerConfig, lengths: Sequence[int]) -> bool:
    """Whether these rows are packed: `use_packing`, and for `packing: auto` the modelled
    cost per token, padded positions of the token-budget plan against real tokens × (1 +
    `PACKING_OVERHEAD`)."""
    if not use_packing(cfg) or not lengths:
        return False
    if cfg.batching.packing is True:
        return True
    plan = token_budget_micro_batches(lengths, cfg.batching.micro_batch_tokens)
    padded = sum(len(b) * lengths[b[0]] for b in plan)
    return padded > (1 + PACKING_OVERHEAD) * sum(lengths)


def mini_batches(n: int, mini_batch_size: int, seed: int | None = None) -> list[list[int]]:
    """Split `n` responses into consecutive chunks of `mini_batch_size` (the last may be short).

    With `seed`, the order is a seeded permutation first: the same seed gives the same split
    on every rank and after a resume.
    """
    if mini_batch_size < 1:
        raise ValueError("mini_batch_size must be >= 1")
    order = list(range(n))
    if seed is not None:
        random.Random(seed).shuffle(order)
    return [order[i : i + mini_batch_size] for i in range(0, n, mini_batch_size)]


MicroBatch = tuple[list[TrainSequence], bool]  # (rows, real); real=False: a dummy forward


def rank_share(seqs: Sequence[TrainSequence], mini: list[int], dp: DataParallel) -> list[int]:
    """The rows of mini-batch `mini` this rank trains (token totals balanced over ranks)."""
    if dp.world_size == 1:
        return list(mini)
    shares = balance_across_ranks([seqs[i].length for i in mini], dp.world_size)
    return [mini[j] for j in shares[dp.rank]]


def plan_step(
    seqs: Sequence[TrainSequence], mini_batch_size: int, seed: int, dp: DataParallel
) -> list[list[int]]:
    """This rank's rows of each mini-batch (the same seeded split on every rank)."""
    return [rank_share(seqs, mb, dp) for mb in mini_batches(len(seqs), mini_batch_size, seed)]


def plan_micro_batches(
    seqs: Sequence[TrainSequence],
    fallback: TrainSequence,
    budget: int,
    dp: DataParallel,
    packed: bool = False,
) -> list[MicroBatch]:
    """This rank's micro-batches (rows to pad, or to pack), dummies up to the ranks' count.

    Ranks run the same number of forwards: ZeRO-3 gathers parameters in each one.
    """
    lengths = [s.length for s in seqs]
    split = packed_micro_batches if packed else token_budget_micro_batches
    idx = split(lengths, budget) if seqs else []
    target = dp.all_reduce_max(len(idx))
    if seqs and len(idx) < target:
        idx = split(lengths, budget, min_count=target)
    batches: list[MicroBatch] = [([seqs[i] for i in b], True) for b in idx]
    batches += [([fallback], False)] * (target - len(batches))
    return batches


def global_counts(seqs: Sequence[TrainSequence], overlong: bool, dp: DataParallel) -> LossCounts:
    """Loss tokens and sequences of the whole mini-batch, summed over ranks."""
    local = loss_counts(seqs, overlong)
    total = dp.all_reduce_sum(torch.tensor([local.tokens, local.sequences], dtype=torch.int64))
    return LossCounts(tokens=int(total[0]), sequences=int(total[1]))


def token_budget_micro_batches(
    lengths: Sequence[int], max_tokens: int, min_count: int = 1
) -> list[list[int]]:
    """Indices into `lengths` grouped so each micro-batch's padded size `B · L` ≤ `max_tokens`.

    Sorted longest first, then each micro-batch is filled in that order until one more row
    would exceed the budget: rows of similar length share a micro-batch, so padding stays
    low on length-skewed batches. A row longer than the budget gets a micro-batch of its
    own. `min_count` (e.g. the largest count over data-parallel ranks, which must run the
    same number of forwards under ZeRO-3) splits the costliest micro-batches further.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        current = batches[-1] if batches else None
        if current is not None and (len(current) + 1) * lengths[current[0]] <= max_tokens:
            current.append(i)
        else:
            batches.append([i])
    return _split_to_count(batches, lambda b: len(b) * lengths[b[0]], min_count)


def packed_micro_batches(
    lengths: Sequence[int], max_tokens: int, min_count: int = 1
) -> list[list[int]]:
    """Indices into `lengths` in bins of at most `max_tokens` tokens in all, for packing.

    First-fit decreasing: each row, longest first, goes into the first bin with room; a
    row longer than the budget gets a bin of its own. `min_count` as above.
    """
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        k = next((k for k, r in enumerate(room) if lengths[i] <= r), None)
        if k is None:
            bins.append([i])
            room.append(max_tokens - lengths[i])
        else:
            bins[k].append(i)
            room[k] -= lengths[i]
    return _split_to_count(bins, lambda b: sum(lengths[i] for i in b), min_count)


def _split_to_count(
    batches: list[list[int]], cost: Callable[[list[int]], int], min_count: int
) -> list[list[int]]:
    """Halve the costliest splittable micro-batch until there are `min_count` (if possible)."""
    while len(batches) < min_count:
        splittable = [b for b in batches if len(b) > 1]
        if not splittable:
            break
        worst = max(splittable, key=cost)
        k = batches.index(worst)
        half = len(worst) // 2
        batches[k : k + 1] = [worst[:half], worst[half:]]
    return batches


def fixed_size_micro_batches(n: int, size: int) -> list[list[int]]:
    """The naive split: consecutive chunks of `size` rows, whatever their lengths."""
    return [list(range(i, min(i + size, n))) for i in range(0, n, size)]


def padding_fraction(lengths: Sequence[int], batches: Sequence[Sequence[int]]) -> float:
    """Share of padded positions over all micro-batches: 1 − real tokens / Σ B · L."""
    real = sum(lengths[i] for b in batches for i in b)
    padded = sum(len(b) * max(lengths[i] for i in b) for b in batches if b)
    return 1.0 - real / padded if padded else 0.0


def balance_across_ranks(lengths: Sequence[int], world_size: int) -> list[list[int]]:
    """Deal rows to `world_size` ranks so their token totals are close (longest first).

    Token totals are balanced, not row counts (a rank may get no rows if there are fewer
    rows than ranks). Ranks then agree on a common micro-batch count and pass it as
    `token_budget_micro_batches(min_count=...)`.
    """
    ranks: list[list[int]] = [[] for _ in range(world_size)]
    totals = [0] * world_size
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(world_size), key=lambda k: (totals[k], k))
        ranks[r].append(i)
        totals[r] += lengths[i]
    return ranks
