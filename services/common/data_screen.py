"""Screening training prompts at load: what a rollout server would refuse never becomes a group.

As verl's `filter_overlong_prompts` does, overlong and empty prompts are skipped and
counted by reason; data where nothing is left, rows that break the schema and one prompt
id given to two prompts (a resumed group finds its prompt by id) are errors, not a run
that waits forever. docs/reliability.md, "Data checked at load".
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from services.common.data import DataError, PromptRecord
from services.common.prompt_tokens import PromptCounter

EMPTY, TOO_LONG = "empty_prompt", "prompt_too_long"


@dataclass(frozen=True)
class ScreenedData:
    """The usable prompts of a dataset and how many rows were skipped, by reason."""

    source: str
    rows: int
    records: list[PromptRecord]
    filtered: dict[str, int] = field(default_factory=dict)
    max_prompt_length: int = 0
    counted: bool = True  # False: no token counter here, lengths were not checked

    def counts(self) -> dict[str, int]:
        """What the controller writes to the run's `dataset` hash."""
        return {
            "rows": self.rows,
            "usable": len(self.records),
            **{f"filtered:{reason}": n for reason, n in self.filtered.items()},
        }

    def describe(self) -> str:
        """One line: `data F: 30 rows, 29 usable; skipped prompt_too_long 1 (> 16 tokens)`."""
        line = f"data {self.source}: {self.rows} rows, {len(self.records)} usable"
        if self.filtered:
            line += "; skipped " + ", ".join(
                f"{reason} {n}" + (self._bound() if reason == TOO_LONG else "")
                for reason, n in sorted(self.filtered.items())
            )
        if not self.counted:
            line += "; prompt lengths not checked (no tokenizer here)"
        return line

    def _bound(self) -> str:
        return f" (> shared.max_prompt_length={self.max_prompt_length} tokens)"


def check_ids(records: Iterable[PromptRecord], source: str) -> None:
    """DataError if one prompt id names two different prompts (repeats of one are fine)."""
    seen: dict[str, tuple[int, tuple[str, str]]] = {}
    for row, record in enumerate(records):
        content = (record.prompt, record.ground_truth)
        first = seen.setdefault(record.prompt_id, (row, content))
        if first[1] != content:
            raise DataError(
                f"{source} rows {first[0]} and {row}: prompt id {record.prompt_id!r} "
                "names two different prompts (extra_info.index must be unique per problem)"
            )


def screen(
    records: list[PromptRecord],
    source: str,
    counter: PromptCounter | None,
    max_prompt_length: int,
) -> ScreenedData:
    """Skip empty and (with a counter) overlong prompts, counting each reason."""
    lengths: dict[str, int] = {}  # files repeat problems: count each text once
    kept, skipped = [], Counter[str]()
    for record in records:
        reason = _skip_reason(record.prompt, counter, max_prompt_length, lengths)
        if reason is None:
            kept.append(record)
        else:
            skipped[reason] += 1
    return ScreenedData(
        source, len(records), kept, dict(skipped), max_prompt_length, counter is not None
    )


def _skip_reason(
    prompt: str, counter: PromptCounter | None, limit: int, lengths: dict[str, int]
) -> str | None:
    if not prompt.strip():
        return EMPTY
    if counter is None:
        return None
    if prompt not in lengths:
        lengths[prompt] = counter(prompt)
    if lengths[prompt] == 0:  # nothing the tokenizer knows: the server refuses it as empty
        return EMPTY
    return TOO_LONG if lengths[prompt] > limit else None


def require_usable(data: ScreenedData) -> ScreenedData:
    """`data`, or DataError when screening left no prompt (the run could never start)."""
    if data.records:
        return data
    if data.rows == 0:
        raise DataError(f"{data.source}: the dataset holds no prompts")
    raise DataError(f"every prompt was skipped at load: {data.describe()}")
