"""Prompt data: DAPO-format parquet/JSONL loaders and built-in synthetic tasks (torch-free).

Every source yields `PromptRecord`s: DAPO-format rows (DAPO-Math-17k, AIME-2024) or the
synthetic tasks a model trained from scratch on a CPU can learn in minutes (`max3`,
`copy2`, `reverse2`, the `mixed` mix; the reasoning tasks live in
services/common/reasoning.py). The row layout, the tasks, mixes and their splits:
docs/tasks.md, "Data files, tasks and mixes".
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import random
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.common.reasoning import REASONING_TASKS, gold_response, parse_prompt
from services.common.reasoning import answer as reasoning_answer
from services.common.reasoning import split_pool as reasoning_split

REQUIRED_COLUMNS = ("data_source", "prompt", "reward_model")
SUFFIXES = (".parquet", ".jsonl")
SPLITS = ("train", "test")
HELD_OUT_FRACTION = 0.2
SYNTHETIC_ABILITY = "synthetic"
# The load line's count of ground truths written as integral floats (`3.0` → `3`).
FLOAT_GROUND_TRUTH = "float_ground_truth_normalised"


class DataError(ValueError):
    """A data file that cannot be used; the message is one line naming the file and why."""


@dataclass
class PromptRecord:
    """One prompt with its gold answer, as every service sees it.

    `messages` is the conversation the policy sees, whole; `prompt` its last user turn
    (what ids and logs name); `prompt_token_ids` the conversation rendered by the model's
    tokenizer at load (services/common/tokenizer.py), empty until then.
    """

    prompt_id: str
    prompt: str
    ground_truth: str
    data_source: str
    ability: str = ""
    reward_style: str = "rule"
    index: int | str | None = None
    raw_problem: str = ""
    split: str | None = None
    messages: list[dict[str, str]] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        # A record built from bare text is a single user turn, as DAPO rows are.
        if not self.messages:
            self.messages = [{"role": "user", "content": self.prompt}]

    def to_row(self) -> dict[str, Any]:
        """The DAPO-format row for this record (what the writers store)."""
        return {
            "data_source": self.data_source,
            "prompt": self.messages,
            "ability": self.ability,
            "reward_model": {"ground_truth": self.ground_truth, "style": self.reward_style},
            "extra_info": {
                "index": self.index,
                "raw_problem": self.raw_problem,
                "split": self.split,
            },
        }


def record_from_row(
    row: dict[str, Any], where: str = "row", tally: Counter[str] | None = None
) -> PromptRecord:
    """Build a record from one DAPO-format row; `where` (file and row) prefixes any error
    message, which names the column; `tally` counts the ground truths normalised."""
    missing = [c for c in REQUIRED_COLUMNS if c not in row]
    if missing:
        raise DataError(f"{where}: missing columns: {', '.join(missing)}")
    messages = _messages(row["prompt"], where)
    reward = _object(row["reward_model"], where, "reward_model", '{"ground_truth": "3"}')
    if reward.get("ground_truth") is None:
        raise DataError(f"{where}: column reward_model has no ground_truth")
    gold, normalised = ground_truth_text(reward["ground_truth"], where)
    if normalised and tally is not None:
        tally[FLOAT_GROUND_TRUTH] += 1
    extra = _object(row.get("extra_info"), where, "extra_info", '{"index": 0}')
    source = str(row["data_source"])
    prompt = _user_content(messages, where)
    return PromptRecord(
        prompt_id=_prompt_id(source, extra.get("index"), prompt),
        prompt=prompt,
        ground_truth=gold,
        data_source=source,
        ability=str(row.get("ability") or ""),
        reward_style=str(reward.get("style") or "rule"),
        index=extra.get("index"),
        raw_problem=str(extra.get("raw_problem") or ""),
        split=extra.get("split"),
        messages=messages,
    )


def _object(value: Any, where: str, column: str, example: str) -> dict[str, Any]:
    """A column holding an object (None: an empty one), or DataError naming the column."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        shown = json.dumps(value, ensure_ascii=False, default=str)[:40]
        raise DataError(
            f"{where}: column {column} must be an object such as {example}, "
            f"got {type(value).__name__} {shown}"
        )
    return value


def ground_truth_text(value: Any, where: str) -> tuple[str, bool]:
    """The gold answer as text, and whether it was normalised: an integral float (`3.0`,
    as pandas writes a numeric column) is the integer `3`, which a verifier can match."""
    if isinstance(value, bool) or not isinstance(value, float):
        if isinstance(value, dict | list):
            raise DataError(f"{where}: column reward_model.ground_truth must be text or a number")
        return str(value), False
    if not math.isfinite(value):
        raise DataError(f"{where}: column reward_model.ground_truth is {value}")
    if value.is_integer():
        return str(int(value)), True
    return repr(value), False


def _messages(prompt: Any, where: str) -> list[dict[str, str]]:
    """The chat messages of a row's `prompt` column."""
    if not isinstance(prompt, list) or not prompt:
        raise DataError(f"{where}: column prompt must be a non-empty list of {{role, content}}")
    try:
        return [{"role": str(m["role"]), "content": str(m["content"])} for m in prompt]
    except (KeyError, TypeError) as exc:
        raise DataError(f"{where}: column prompt: messages need role and content ({exc!r})") from (
            None
        )


def _user_content(messages: list[dict[str, str]], where: str) -> str:
    """The last user message: the text a verifier-facing prompt is built from."""
    for message in reversed(messages):
        if message["role"] == "user":
            return message["content"]
    raise DataError(f"{where}: column prompt has no user message")


def _prompt_id(source: str, index: Any, prompt: str) -> str:
    """Stable id: the row's own index when it has one, else a hash of the prompt text."""
    if index is None:
        index = hashlib.sha1(prompt.encode()).hexdigest()[:12]
    return f"{source}-{index}"


# --------------------------------------------------------------------------- loaders


def load_records(
    path: str | Path,
    unique: bool = False,
    limit: int | None = None,
    tally: Counter[str] | None = None,
) -> list[PromptRecord]:
    """Load a `.parquet` or `.jsonl` file of DAPO-format rows.

    `unique` keeps the first record of each `prompt_id` (files that repeat problems for
    avg@k evaluation); `limit` truncates after deduplication; `tally` counts what loading
    normalised.
    """
    path = _check_path(path)
    loader = load_parquet if path.suffix == ".parquet" else load_jsonl
    records = loader(path, tally)
    if unique:
        records = unique_records(records)
    return records if limit is None else records[:limit]


def _check_path(path: str | Path) -> Path:
    path = Path(path)
    if path.suffix not in SUFFIXES:
        expected = " or ".join(SUFFIXES)
        raise DataError(f"{path}: unsupported extension {path.suffix!r} (expected {expected})")
    if not path.is_file():
        raise DataError(f"{path}: data file not found")
    return path


def load_parquet(path: str | Path, tally: Counter[str] | None = None) -> list[PromptRecord]:
    """Read a DAPO-format parquet file (only the columns a record needs)."""
    import pyarrow.parquet as pq

    path = _check_path(path)
    try:
        names = pq.read_schema(path).names
        missing = [c for c in REQUIRED_COLUMNS if c not in names]
        if missing:
            raise DataError(f"{path}: missing columns: {', '.join(missing)}")
        wanted = [c for c in (*REQUIRED_COLUMNS, "ability", "extra_info") if c in names]
        rows = pq.read_table(path, columns=wanted).to_pylist()
    except DataError:
        raise
    except Exception as exc:  # pyarrow raises several types for unreadable files
        raise DataError(f"{path}: cannot read parquet: {_one_line(exc)}") from None
    return [record_from_row(row, f"{path} row {i}", tally) for i, row in enumerate(rows)]


def load_jsonl(path: str | Path, tally: Counter[str] | None = None) -> list[PromptRecord]:
    """Read DAPO-format rows, one JSON object per line (blank lines are skipped)."""
    path = _check_path(path)
    records = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{where}: invalid JSON: {exc.msg}") from None
            if not isinstance(row, dict):
                raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
            records.append(record_from_row(row, where, tally))
    return records


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def unique_records(
    records: Iterable[PromptRecord], key: Callable[[PromptRecord], Any] | None = None
) -> list[PromptRecord]:
    """Keep the first record per key (default `prompt_id`), preserving order."""
    key = key or (lambda r: r.prompt_id)
    seen: set[Any] = set()
    kept = []
    for record in records:
        k = key(record)
        if k not in seen:
            seen.add(k)
            kept.append(record)
    return kept


# --------------------------------------------------------------------------- writers


def write_records(records: Iterable[PromptRecord], path: str | Path) -> Path:
    """Write records as DAPO-format rows; the extension (.parquet/.jsonl) picks the format."""
    path = Path(path)
    if path.suffix not in SUFFIXES:
        expected = " or ".join(SUFFIXES)
        raise DataError(f"{path}: unsupported extension {path.suffix!r} (expected {expected})")
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [r.to_row() for r in records]
    if path.suffix == ".jsonl":
        with path.open("w", encoding="utf-8") as fh:
            fh.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    return path


# --------------------------------------------------------------------------- synthetic


@dataclass(frozen=True)
class SyntheticTask:
    """A task over all tuples of `arity` digits; `answer` maps the digits to the gold text."""

    arity: int
    answer: Callable[[tuple[int, ...]], str]


SYNTHETIC_TASKS: dict[str, SyntheticTask] = {
    "max3": SyntheticTask(3, lambda d: str(max(d))),
    "copy2": SyntheticTask(2, lambda d: "".join(map(str, d))),
    "reverse2": SyntheticTask(2, lambda d: "".join(map(str, reversed(d)))),
}


# Mixes of tasks with distinct arities (a prompt's digit count says which task it is).
SYNTHETIC_MIXES: dict[str, tuple[str, ...]] = {"mixed": ("max3", "copy2")}
# Tasks with a scratchpad and the paper's `Answer:` line (services/common/reasoning.py).
SYNTHETIC_NAMES = (*SYNTHETIC_TASKS, *SYNTHETIC_MIXES, *REASONING_TASKS)


def synthetic_prompt(digits: Iterable[int]) -> str:
    """The prompt for a digit tuple: `3,7,1=`."""
    return ",".join(map(str, digits)) + "="


def synthetic_split(task: str, split: str) -> list[PromptRecord]:
    """Every prompt of `task` in `split`, in canonical order.

    The split is fixed per task (independent of any run seed), so train and test never
    share a prompt whatever seeds callers use: a fixed shuffle of all digit tuples puts
    the first 20% in "test". A mix is the concatenation of its parts' splits.
    """
    if task in SYNTHETIC_MIXES:
        return [r for part in SYNTHETIC_MIXES[task] for r in synthetic_split(part, split)]
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}")
    if task in REASONING_TASKS:
        return [
            _synthetic_record(task, i, digits, reasoning_answer(task, digits), split)
            for i, digits in reasoning_split(task, split)
        ]
    spec = _task(task)
    universe = list(itertools.product(range(10), repeat=spec.arity))
    order = list(range(len(universe)))
    random.Random(f"dapo-synthetic-{task}").shuffle(order)
    n_test = round(len(universe) * HELD_OUT_FRACTION)
    chosen = order[:n_test] if split == "test" else order[n_test:]
    return [
        _synthetic_record(task, i, universe[i], spec.answer(universe[i]), split)
        for i in sorted(chosen)
    ]


def _task(task: str) -> SyntheticTask:
    if task not in SYNTHETIC_TASKS:
        valid = ", ".join(SYNTHETIC_NAMES)
        raise ValueError(f"unknown synthetic task {task!r}; valid tasks: {valid}")
    return SYNTHETIC_TASKS[task]


def _synthetic_record(
    task: str, index: int, digits: tuple[int, ...], gold: str, split: str
) -> PromptRecord:
    prompt = synthetic_prompt(digits)
    source = f"synthetic_{task}"
    return PromptRecord(
        prompt_id=f"{source}-{index}",
        prompt=prompt,
        ground_truth=gold,
        data_source=source,
        ability=SYNTHETIC_ABILITY,
        index=index,
        raw_problem=prompt,
        split=split,
    )


def synthetic_records(
    task: str, n: int | None = None, seed: int = 0, split: str = "train"
) -> list[PromptRecord]:
    """`n` distinct prompts of `task` from `split`, in a seeded order (all of them if None).

    Pools: max3 has 800 train / 200 test prompts, copy2 and reverse2 80 / 20, mixed
    880 / 220.
    """
    pool = synthetic_split(task, split)
    random.Random(seed).shuffle(pool)
    if n is None:
        return pool
    if not 0 <= n <= len(pool):
        raise ValueError(f"n={n} out of range: {task}/{split} has {len(pool)} prompts")
    return pool[:n]


def iter_synthetic_corpus() -> Iterator[str]:
    """Every synthetic prompt, answer and reference response (the tiny tokenizer's alphabet)."""
    for task in (*SYNTHETIC_TASKS, *REASONING_TASKS):
        for split in SPLITS:
            for record in synthetic_split(task, split):
                yield record.prompt
                yield record.ground_truth
                if task in REASONING_TASKS:
                    yield gold_response(task, parse_prompt(record.prompt))


def aime_path() -> Path:
    """Where the AIME-2024 eval set is: $DAPO_AIME_PARQUET, else shared/data/ beside the repository.

    The file is never copied into the project; tests and benchmarks skip (saying so)
    when it is absent.
    """
    default = Path(__file__).resolve().parents[3] / "shared" / "data" / "aime-2024.parquet"
    return Path(os.environ.get("DAPO_AIME_PARQUET", default))
