"""The controller's prompt source: epochs over a dataset, seeded shuffles, a resumable cursor."""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator
from dataclasses import dataclass

from services.common.data import PromptRecord, load_records, synthetic_records, unique_records
from services.common.data_screen import ScreenedData, check_ids, require_usable, screen
from services.common.errors import DapoError
from services.common.prompt_tokens import CounterUnavailable, PromptCounter, prompt_counter
from services.controller.config import DatasetConfig, EvalConfig

log = logging.getLogger(__name__)


def load_dataset(cfg: DatasetConfig, seed: int) -> list[PromptRecord]:
    """The training prompts named by the config, or a DapoError saying what is wrong."""
    try:
        if cfg.kind == "synthetic":
            return synthetic_records(cfg.synthetic_task, cfg.synthetic_size, seed, "train")
        if cfg.path is None:
            raise DapoError(f"controller.dataset.path is required for kind={cfg.kind}")
        return load_records(cfg.path)
    except ValueError as exc:
        raise DapoError(str(exc)) from None


def load_training_data(
    cfg: DatasetConfig,
    seed: int,
    model_path: str | None,
    chat: bool,
    max_prompt_length: int,
) -> ScreenedData:
    """The training prompts a run can use, validated and screened at load (data_screen.py),
    or a DapoError naming the file, row and column or saying why nothing is left.

    Prompt lengths are counted with the model's tokenizer as a rollout server counts them;
    where it cannot be read here the lengths are left to the rollout servers (a refused
    prompt's group is then rejected with the reason).
    """
    records = load_dataset(cfg, seed)
    source = cfg.path if cfg.kind != "synthetic" else f"synthetic:{cfg.synthetic_task}"
    try:
        check_ids(records, str(source))
        counter = counter_or_none(model_path, chat)
        data = screen(records, str(source), counter, max_prompt_length)
        return require_usable(data)
    except ValueError as exc:
        raise DapoError(str(exc)) from None


def counter_or_none(model_path: str | None, chat: bool) -> PromptCounter | None:
    """The prompt token counter, or None (logged) where it cannot be built here."""
    try:
        return prompt_counter(model_path, chat)
    except CounterUnavailable as exc:
        log.warning("prompt lengths are not checked at load: %s", exc)
        return None


def eval_data_spec(cfg: EvalConfig, dataset: DatasetConfig) -> str | None:
    """What a run evaluates on: `controller.eval.data`, else the synthetic training task's
    held-out split (`synthetic:TASK`); None when neither names any data."""
    if cfg.data is None and dataset.kind == "synthetic":
        return f"synthetic:{dataset.synthetic_task}"
    return cfg.data


def load_eval_records(spec: str, limit: int | None = None) -> list[PromptRecord]:
    """One record per problem of a parquet/jsonl file, or `synthetic:TASK`'s test split.

    Eval files repeat each problem (AIME: 32 copies; DAPO-Math-17k: about 100, whose
    copies need not share an index), so problems are told apart by their prompt and
    gold answer, not by row; `limit` keeps the first N problems.
    """
    try:
        if spec.startswith("synthetic:"):
            records = synthetic_records(spec.split(":", 1)[1], split="test")
        else:
            records = unique_records(load_records(spec), key=lambda r: (r.prompt, r.ground_truth))
    except ValueError as exc:
        raise DapoError(str(exc)) from None
    return records[:limit] if limit else records


@dataclass(frozen=True)
class Cursor:
    """Position in the prompt stream: the next prompt is order(epoch)[index]."""

    epoch: int = 0
    index: int = 0

    def encode(self) -> str:
        return f"{self.epoch}:{self.index}"

    @classmethod
    def decode(cls, text: str | bytes | None) -> Cursor:
        if not text:
            return cls()
        epoch, index = (text.decode() if isinstance(text, bytes) else text).split(":")
        return cls(int(epoch), int(index))


def epoch_order(n: int, epoch: int, seed: int, shuffle: bool) -> list[int]:
    """The order of the n prompts in one epoch (a fresh seeded shuffle per epoch)."""
    order = list(range(n))
    if shuffle:
        random.Random(f"{seed}-{epoch}").shuffle(order)
    return order


def iterate(
    records: list[PromptRecord], start: Cursor, seed: int, shuffle: bool
) -> Iterator[tuple[Cursor, PromptRecord]]:
    """Endless (epoch, record) stream from `start`; each item carries the cursor after it."""
    if not records:
        raise DapoError("the dataset holds no prompts")
    epoch, index = start.epoch, start.index
    while True:
        order = epoch_order(len(records), epoch, seed, shuffle)
        while index < len(order):
            record = records[order[index]]
            index += 1
            yield Cursor(epoch, index), record
        epoch, index = epoch + 1, 0
