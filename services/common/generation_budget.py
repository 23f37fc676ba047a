"""How much generation a training step may wait for (bounded dynamic sampling).

The DAPO paper refills a batch until it holds N informative groups, however many groups
that takes. Once a task is nearly solved almost every group comes back all-correct and
is filtered, so a step can wait for hundreds of groups per group it trains (measured on
the tiny demo: 125,036 groups generated to train 1,920). With a budget of `ratio`, a
step waits for at most ratio × N groups decided by the buffer (kept or filtered) since
the previous batch was taken; past that it trains on the informative groups it holds,
at least one (verl's `max_num_gen_batches` bounds the same thing, by raising an error).

A short batch keeps the loss exact: the learner's token-level loss divides by the
tokens of each mini-batch it actually trains (learner/step.py), whatever the batch size.
"""

from __future__ import annotations

from services.common.ledger import prefixed


def decided_groups(counters: dict[str, int]) -> int:
    """Groups the buffer has decided (kept + filtered for any reason), from the ledger hash."""
    return counters.get("kept", 0) + sum(prefixed(counters, "filtered:").values())


def budget_spent(generated: int, need: int, ratio: float | None) -> bool:
    """Whether `generated` groups since the last batch exhaust the budget of ratio × need."""
    return ratio is not None and generated >= ratio * need


def batch_ready(held: int, need: int, generated: int, ratio: float | None) -> bool:
    """A step may start: the batch is full, or the budget is spent and it holds a group."""
    return held >= need or (held > 0 and budget_spent(generated, need, ratio))
