"""Soft overlong punishment and the overlong flag (the paper's "Overlong reward shaping",
equation 13).

With L_max = `max_len`, L_cache = `buffer_len` and expected length L_max - L_cache:

    R_len(y) = 0                                        if |y| <= L_max - L_cache
             = ((L_max - L_cache) - |y|) / L_cache * f  if L_max - L_cache < |y| <= L_max
             = -f                                       if |y| > L_max

with f = `factor` (1.0 in the paper). For |y| <= L_max this is the reference recipe's
`min(-(|y| - (L_max - L_cache)) / L_cache * f, 0)`; beyond L_max, which a generator
capped at L_max never produces, the paper's constant -1 (times f) is used where the
reference formula would keep falling. `buffer_len = 0` means no soft zone: 0 up to
L_max, -f beyond.

Overlong *filtering* is not a reward: the service only passes the `truncated` flag on
(set by the caller, or because the length exceeds L_max) and the learner masks it.
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
