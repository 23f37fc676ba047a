"""Held-out accuracy statistics (pure, torch-free): avg@k, unbiased pass@k and the
length/truncation summary of one evaluation. Shared by `dapo eval` (services/tools) and
the controller's in-run evaluation curve, so both report the same numbers."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al., 2021):
    1 - C(n-c, k) / C(n, k), as a product so large n never overflows."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def summarise(correct: Sequence[Sequence[bool]], k: int) -> dict[str, float]:
    """avg@k (mean accuracy over all samples) and pass@k over prompts."""
    flat = [c for row in correct for c in row]
    return {
        f"avg@{k}": sum(flat) / max(len(flat), 1),
        f"pass@{k}": sum(pass_at_k(len(r), sum(r), k) for r in correct) / max(len(correct), 1),
        "prompts": len(correct),
        "samples": len(flat),
    }


def curve_point(
    correct: Sequence[Sequence[bool]],
    lengths: Sequence[Sequence[int]],
    truncated: Sequence[Sequence[bool]],
    k: int,
) -> dict[str, Any]:
    """One point of an evaluation curve: avg@k, pass@k, mean response length (tokens)
    and the share of responses cut off at the length limit."""
    flat_len = [n for row in lengths for n in row]
    flat_cut = [t for row in truncated for t in row]
    return {
        **summarise(correct, k),
        "response_length": sum(flat_len) / max(len(flat_len), 1),
        "truncation_rate": sum(flat_cut) / max(len(flat_cut), 1),
    }
