"""The controller's prompt stream: epochs, resumable cursors and answer-balanced draws."""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter
from dataclasses import replace

import pytest

from services.common.data import synthetic_records
from services.controller.dataset import Cursor, answer_weights, draw_counts, iterate

RECORDS = synthetic_records("max3", seed=0)  # answers 0-9; 4 and below are 12.5% of them


def drawn_answers(balance: float, n: int, seed: int = 0) -> Counter[str]:
    stream = iterate(RECORDS, Cursor(), seed, shuffle=True, balance=balance)
    return Counter(record.ground_truth for _, record in itertools.islice(stream, n))


def small_share(counts: Counter[str]) -> float:
    return sum(c for a, c in counts.items() if int(a) <= 4) / sum(counts.values())


def test_without_balance_an_epoch_is_every_prompt_once() -> None:
    epoch = [r.prompt_id for _, r in itertools.islice(iterate(RECORDS, Cursor(), 3, True), 800)]
    assert sorted(epoch) == sorted(r.prompt_id for r in RECORDS)


def test_balance_on_distinct_answers_is_still_every_prompt_once_per_epoch() -> None:
    """Data whose answers are all different (most math sets) gets the plain epoch: the
    draws are floors and ceilings of each prompt's expected count, not random picks."""
    distinct = [replace(r, ground_truth=str(100 + i)) for i, r in enumerate(RECORDS[:99])]
    for epoch_start in (0, 1, 5):
        stream = iterate(distinct, Cursor(epoch_start, 0), 11, True, 1.0)
        epoch = [r.prompt_id for _, r in itertools.islice(stream, len(distinct))]
        assert sorted(epoch) == sorted(r.prompt_id for r in distinct)


def test_balanced_counts_are_the_floor_or_ceiling_of_the_expected() -> None:
    weights = answer_weights([r.ground_truth for r in RECORDS], 0.5)
    assert weights is not None
    counts = draw_counts(weights, random.Random(4))
    total = sum(weights)
    assert sum(counts) == len(RECORDS)
    for w, c in zip(weights, counts, strict=True):
        assert math.floor(len(RECORDS) * w / total) <= c <= math.ceil(len(RECORDS) * w / total)


def test_balance_moves_answer_shares_from_frequency_toward_uniform() -> None:
    natural = small_share(Counter(r.ground_truth for r in RECORDS))
    half, full = small_share(drawn_answers(0.5, 8000)), small_share(drawn_answers(1.0, 8000))
    assert natural == pytest.approx(0.125, abs=0.01)
    assert natural + 0.05 < half < full - 0.1  # sqrt: ~0.25; uniform over 10 answers: ~0.5
    uniform = drawn_answers(1.0, 8000)
    assert max(uniform.values()) < 1.3 * min(uniform.values())


def test_a_resumed_cursor_continues_the_same_balanced_draws() -> None:
    """The draws are a function of (seed, epoch): a restart mid-epoch goes on with them."""
    whole = list(itertools.islice(iterate(RECORDS, Cursor(), 7, True, 0.5), 1000))
    cursor, _ = whole[449]
    resumed = list(itertools.islice(iterate(RECORDS, cursor, 7, True, 0.5), 550))
    assert [r.prompt_id for _, r in resumed] == [r.prompt_id for _, r in whole[450:]]
    assert [c for c, _ in resumed] == [c for c, _ in whole[450:]]


def test_weights_are_none_at_zero_and_inverse_count_powers_above() -> None:
    assert answer_weights(["1", "2", "2"], 0.0) is None
    assert answer_weights(["1", "2", "2", "2", "2"], 0.5) == [1.0, 0.5, 0.5, 0.5, 0.5]
