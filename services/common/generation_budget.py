"""How much generation a training step may wait for (bounded dynamic sampling).

The paper refills a batch until it holds N informative groups; once a task is nearly
solved a step can wait for hundreds of groups per group it trains. With a budget of
`ratio`, a step waits for at most ratio × N groups decided since the previous batch, then
trains on the informative groups it holds (at least one); the token-level loss stays
exact. docs/architecture.md, "When the data gets easy".
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
