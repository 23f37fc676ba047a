"""Soft overlong punishment and the overlong flag (the paper's "Overlong reward shaping",
equation 13).

0 up to L_max - L_cache, then falling linearly to -f at L_max, and -f beyond (`max_len`,
`buffer_len`, `factor`). Where it follows the reference recipe and where the paper, and
why overlong filtering is only a flag here: docs/reward.md, "Overlong punishment".
"""

from __future__ import annotations

from dataclasses import dataclass


def overlong_penalty(length: int, max_len: int, buffer_len: int, factor: float) -> float:
    """The soft overlong punishment (<= 0) for a response of `length` tokens."""
    expected = max_len - buffer_len
    if length <= expected:
        return 0.0
    if length <= max_len:
        return (expected - length) / buffer_len * factor
    return -factor


def is_overlong(length: int, max_len: int, truncated: bool) -> bool:
    """Whether the learner should mask this response (overlong filtering)."""
    return truncated or length > max_len


@dataclass(frozen=True)
class OverlongShaping:
    """The shared section's lengths, bound once; `enabled` = add the penalty to rewards."""

    max_len: int
    buffer_len: int
    factor: float
    enabled: bool = True

    def penalty(self, length: int) -> float:
        """Penalty for a length in tokens; 0 when disabled or when the length is unknown."""
        if not self.enabled or length <= 0:
            return 0.0
        return overlong_penalty(length, self.max_len, self.buffer_len, self.factor)
