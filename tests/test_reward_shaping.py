"""Soft overlong punishment: the three branches and their boundaries (DAPO.md)."""

from __future__ import annotations

import pytest

from reward.shaping import OverlongShaping, is_overlong, overlong_penalty

L_MAX, L_CACHE = 20480, 4096  # the paper's values; expected length 16384


@pytest.mark.parametrize(
    ("length", "penalty"),
    [
        (1, 0.0),
        (16384, 0.0),  # last length with no penalty
        (16385, -1 / 4096),  # first penalised length
        (16384 + 1024, -0.25),
        (16384 + 2048, -0.5),
        (20480, -1.0),  # L_max itself: the soft zone's end
        (20481, -1.0),  # beyond L_max: constant -1
        (10**9, -1.0),
    ],
)
def test_paper_values(length: int, penalty: float) -> None:
    assert overlong_penalty(length, L_MAX, L_CACHE, 1.0) == pytest.approx(penalty, abs=1e-12)


def test_matches_reference_formula_inside_the_limit() -> None:
    for length in range(16000, L_MAX + 1, 37):
        reference = min(-(length - (L_MAX - L_CACHE)) / L_CACHE * 0.5, 0.0)
        assert overlong_penalty(length, L_MAX, L_CACHE, 0.5) == pytest.approx(reference)


def test_factor_scales_every_branch() -> None:
    assert overlong_penalty(16384 + 2048, L_MAX, L_CACHE, 2.0) == pytest.approx(-1.0)
    assert overlong_penalty(30000, L_MAX, L_CACHE, 2.0) == -2.0
    assert overlong_penalty(100, L_MAX, L_CACHE, 2.0) == 0.0


def test_zero_buffer_is_a_step_without_division_by_zero() -> None:
    assert overlong_penalty(4, 4, 0, 1.0) == 0.0
    assert overlong_penalty(5, 4, 0, 1.0) == -1.0


def test_shaping_object_disabled_or_unknown_length() -> None:
    on = OverlongShaping(L_MAX, L_CACHE, 1.0)
    off = OverlongShaping(L_MAX, L_CACHE, 1.0, enabled=False)
    assert on.penalty(16384 + 2048) == pytest.approx(-0.5)
    assert off.penalty(16384 + 2048) == 0.0
    assert on.penalty(0) == 0.0  # 0 = length not given


def test_overlong_flag_for_filtering() -> None:
    assert is_overlong(10, L_MAX, truncated=True)
    assert is_overlong(L_MAX + 1, L_MAX, truncated=False)
    assert not is_overlong(L_MAX, L_MAX, truncated=False)
