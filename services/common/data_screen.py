"""Screening training prompts at load: what a rollout server would refuse never becomes a group.

Each prompt's whole conversation is rendered and tokenized here, once, by the model's own
tokenizer (services/common/tokenizer.py). As verl's `filter_overlong_prompts` does,
overlong and empty prompts (and empty ground truths) are skipped and counted by reason;
data where nothing is left, rows that break the schema and one prompt id given to two
prompts are errors; what a careful user would notice (a verifier that cannot score the
answers' form, a tokenizer that drops characters, eval data that is training data) is
warned of. docs/reliability.md, "Data checked at load".
"""

from __future__ import annotations

import random
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from services.common.data import FLOAT_GROUND_TRUTH, DataError, PromptRecord
from services.common.tokenizer import PromptTokenizer

EMPTY, TOO_LONG, NO_GOLD = "empty_prompt", "prompt_too_long", "empty_ground_truth"
# A prompt of this many characters or more that keeps fewer than chars / CHARS_PER_TOKEN
# tokens lost characters its tokenizer does not know (a real BPE keeps about 1 per 3-4).
MIN_CHARS, CHARS_PER_TOKEN = 64, 12
SAMPLE = 200  # ground truths looked at for the verifier's form
INTEGER = re.compile(r"^\s*[-+]?\d+\s*$")


@dataclass(frozen=True)
class ScreenedData:
    """The usable prompts of a dataset and how many rows were skipped, by reason."""

    source: str
    rows: int
    records: list[PromptRecord]
    filtered: dict[str, int] = field(default_factory=dict)
    max_prompt_length: int = 0
    normalised: dict[str, int] = field(default_factory=dict)  # e.g. float ground truths
    warnings: list[str] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        """What the controller writes to the run's `dataset` hash."""
        return {
            "rows": self.rows,
            "usable": len(self.records),
            **{f"filtered:{reason}": n for reason, n in self.filtered.items()},
            **{f"normalised:{what}": n for what, n in self.normalised.items()},
        }

    def describe(self) -> str:
        """One line: `data F: 30 rows, 29 usable; skipped prompt_too_long 1 (> 16 tokens)`."""
        line = f"data {self.source}: {self.rows} rows, {len(self.records)} usable"
        if self.filtered:
            line += "; skipped " + ", ".join(
                f"{reason} {n}" + (self._bound() if reason == TOO_LONG else "")
                for reason, n in sorted(self.filtered.items())
            )
        for what, n in sorted(self.normalised.items()):
            line += f"; {n} {_NORMALISED.get(what, what)}"
        return line

    def with_warnings(self, *warnings: str | None) -> ScreenedData:
        """The same data with these warnings (None: nothing to warn of) added."""
        found = [w for w in warnings if w]
        return ScreenedData(
            self.source,
            self.rows,
            self.records,
            self.filtered,
            self.max_prompt_length,
            self.normalised,
            [*self.warnings, *found],
        )

    def _bound(self) -> str:
        return f" (> shared.max_prompt_length={self.max_prompt_length} tokens)"


def check_ids(records: Iterable[PromptRecord], source: str) -> None:
    """DataError if one prompt id names two different prompts (repeats of one are fine)."""
    seen: dict[str, tuple[int, tuple[str, str]]] = {}
    for row, record in enumerate(records):
        content = (repr(record.messages), record.ground_truth)
        first = seen.setdefault(record.prompt_id, (row, content))
        if first[1] != content:
            raise DataError(
                f"{source} rows {first[0]} and {row}: prompt id {record.prompt_id!r} "
                "names two different prompts (extra_info.index must be unique per problem)"
            )


_NORMALISED = {FLOAT_GROUND_TRUTH: "float ground truths read as integers (3.0 → 3)"}


def screen(
    records: list[PromptRecord],
    source: str,
    tokenizer: PromptTokenizer,
    max_prompt_length: int,
    normalised: Counter[str] | None = None,
) -> ScreenedData:
    """Tokenize each kept record's conversation (`prompt_token_ids`), skipping empty and
    overlong prompts and empty ground truths, counting each reason; DataError naming the
    row when the tokenizer cannot render one (a template that refuses its roles)."""
    ids: dict[str, list[int]] = {}  # files repeat problems: render each conversation once
    kept, skipped = [], Counter[str]()
    for row, record in enumerate(records):
        reason = _skip_reason(record, tokenizer, max_prompt_length, ids, f"{source} row {row}")
        if reason is None:
            kept.append(record)
        else:
            skipped[reason] += 1
    warning = shrink_warning(kept, tokenizer)
    counts = {k: v for k, v in (normalised or {}).items() if v}
    return ScreenedData(
        source, len(records), kept, dict(skipped), max_prompt_length, counts
    ).with_warnings(warning)


def _skip_reason(
    record: PromptRecord,
    tokenizer: PromptTokenizer,
    limit: int,
    ids: dict[str, list[int]],
    where: str,
) -> str | None:
    if not any(m["content"].strip() for m in record.messages):
        return EMPTY
    if not record.ground_truth.strip():
        return NO_GOLD
    key = repr(record.messages)
    if key not in ids:
        try:
            ids[key] = tokenizer.ids(record.messages)
        except ValueError as exc:
            raise DataError(f"{where}: column prompt: {exc}") from None
    record.prompt_token_ids = ids[key]
    if not record.prompt_token_ids:  # nothing the tokenizer knows: the server refuses it
        return EMPTY
    return TOO_LONG if len(record.prompt_token_ids) > limit else None


def shrink_warning(records: list[PromptRecord], tokenizer: PromptTokenizer) -> str | None:
    """Prompts that keep far fewer tokens than their characters suggest: the tokenizer drops
    what it does not know (a tokenizer of another model, or of a tiny alphabet)."""
    shrunk = []
    for record in records:
        chars = sum(len(m["content"]) for m in record.messages)
        if chars >= MIN_CHARS and len(record.prompt_token_ids) * CHARS_PER_TOKEN < chars:
            shrunk.append((chars, len(record.prompt_token_ids)))
    if not shrunk:
        return None
    chars, tokens = shrunk[0]
    return (
        f"{len(shrunk)} of {len(records)} prompts keep far fewer tokens than their characters "
        f"suggest (e.g. {chars} characters → {tokens} tokens): the tokenizer of "
        f"{tokenizer.source} drops characters it does not know; is it the right model?"
    )


def verifier_warning(records: list[PromptRecord], verifier: str, seed: int = 0) -> str | None:
    """`first_integer` scores integers only: ground truths in another form (LaTeX such as
    `\\frac{3}{4}`, text) can never be matched. Judged on a sample of the records."""
    if verifier != "first_integer" or not records:
        return None
    sample = random.Random(seed).sample(records, min(SAMPLE, len(records)))
    other = [r.ground_truth for r in sample if not INTEGER.match(r.ground_truth)]
    if not other:
        return None
    return (
        f"shared.verifier is first_integer but {len(other)} of {len(sample)} sampled ground "
        f"truths are not integers (e.g. {other[0]!r}): they can never be scored correct; "
        "use verifier dapo or math_verify"
    )


def overlap_warning(
    train: list[PromptRecord], held_out: list[PromptRecord], train_source: str, eval_source: str
) -> str | None:
    """Evaluation data that is (partly) the training data, compared by prompt."""
    seen = {repr(r.messages) for r in train}
    shared = sum(repr(r.messages) in seen for r in held_out)
    if not shared:
        return None
    if train_source == eval_source:
        return f"controller.eval.data is the training data ({eval_source}): not held out"
    return (
        f"{shared} of {len(held_out)} eval prompts in {eval_source} are also training prompts "
        f"in {train_source}: the eval is not held out"
    )


def require_usable(data: ScreenedData) -> ScreenedData:
    """`data`, or DataError when screening left no prompt (the run could never start)."""
    if data.records:
        return data
    if data.rows == 0:
        raise DataError(f"{data.source}: the dataset holds no prompts")
    raise DataError(f"every prompt was skipped at load: {data.describe()}")
