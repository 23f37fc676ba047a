"""The controller's prompt source: epochs over a dataset, seeded shuffles, a resumable cursor."""

from __future__ import annotations

import logging
import random
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from services.common.data import PromptRecord, load_records, synthetic_records, unique_records
from services.common.data_screen import (
    ScreenedData,
    check_ids,
    overlap_warning,
    require_usable,
    screen,
    verifier_warning,
)
from services.common.errors import DapoError
from services.common.tokenizer import PromptTokenizer
from services.controller.config import DatasetConfig, EvalConfig

log = logging.getLogger(__name__)

SUFFIX = {"parquet": ".parquet", "jsonl": ".jsonl"}


def check_kind(cfg: DatasetConfig) -> str | None:
    """The file a dataset config names, or None for a synthetic task; DapoError when the
    kind and the path disagree (a path the kind never reads, a file of another format)."""
    if cfg.kind == "synthetic":
        if cfg.path is not None:
            raise DapoError(
                f"controller.dataset.path is {cfg.path} but controller.dataset.kind is "
                "synthetic, which reads no file; set kind=parquet or kind=jsonl"
            )
        return None
    if cfg.path is None:
        raise DapoError(f"controller.dataset.path is required for kind={cfg.kind}")
    suffix = Path(cfg.path).suffix
    if suffix != SUFFIX[cfg.kind]:
        raise DapoError(
            f"controller.dataset.kind is {cfg.kind} but {cfg.path} is a {suffix or 'no-suffix'} "
            f"file; set kind to match the file ({', '.join(SUFFIX)})"
        )
    return cfg.path


def load_dataset(
    cfg: DatasetConfig, seed: int, tally: Counter[str] | None = None
) -> list[PromptRecord]:
    """The training prompts named by the config, or a DapoError saying what is wrong."""
    try:
        path = check_kind(cfg)
        if path is None:
            return synthetic_records(cfg.synthetic_task, cfg.synthetic_size, seed, "train")
        return load_records(path, tally=tally)
    except ValueError as exc:
        raise DapoError(str(exc)) from None


def dataset_source(cfg: DatasetConfig) -> str:
    """How the load line names the training data."""
    return str(cfg.path) if cfg.kind != "synthetic" else f"synthetic:{cfg.synthetic_task}"


def load_training_data(
    cfg: DatasetConfig,
    seed: int,
    tokenizer: PromptTokenizer,
    max_prompt_length: int,
    verifier: str = "default",
) -> ScreenedData:
    """The training prompts a run can use, validated, tokenized and screened at load
    (data_screen.py), or a DapoError naming the file, row and column or saying why
    nothing is left. Warnings (verifier vs ground truths, a lossy tokenizer) ride along."""
    tally = Counter[str]()
    records = load_dataset(cfg, seed, tally)
    source = dataset_source(cfg)
    try:
        check_ids(records, source)
        data = screen(records, source, tokenizer, max_prompt_length, tally)
        data = require_usable(data)
    except ValueError as exc:
        raise DapoError(str(exc)) from None
    return data.with_warnings(verifier_warning(data.records, verifier, seed))


def eval_data_spec(cfg: EvalConfig, dataset: DatasetConfig) -> str | None:
    """What a run evaluates on: `controller.eval.data`, else the synthetic training task's
    held-out split (`synthetic:TASK`); None when neither names any data."""
    if cfg.data is None and dataset.kind == "synthetic":
        return f"synthetic:{dataset.synthetic_task}"
    return cfg.data


def load_eval_records(spec: str, limit: int | None = None) -> list[PromptRecord]:
    """One record per problem of a parquet/jsonl file, or `synthetic:TASK`'s test split.

    Eval files repeat each problem (AIME: 32 copies; DAPO-Math-17k: about 100, whose
    copies need not share an index), so problems are told apart by their conversation
    and gold answer, not by row; `limit` keeps the first N problems.
    """
    try:
        if spec.startswith("synthetic:"):
            records = synthetic_records(spec.split(":", 1)[1], split="test")
        else:
            records = unique_records(
                load_records(spec), key=lambda r: (repr(r.messages), r.ground_truth)
            )
    except ValueError as exc:
        raise DapoError(str(exc)) from None
    return records[:limit] if limit else records


def load_eval_data(
    spec: str,
    limit: int | None,
    tokenizer: PromptTokenizer,
    max_prompt_length: int,
    training: tuple[list[PromptRecord], str] | None = None,
) -> ScreenedData:
    """The held-out prompts, tokenized and screened as training prompts are (a prompt a
    server would refuse would fail every eval point), with a warning when they overlap
    `training` (records, source); DapoError when the file is unusable."""
    records = load_eval_records(spec, limit)
    try:
        data = screen(records, spec, tokenizer, max_prompt_length)
    except ValueError as exc:
        raise DapoError(str(exc)) from None
    if training is None:
        return data
    return data.with_warnings(overlap_warning(training[0], data.records, training[1], spec))


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


def answer_weights(answers: list[str], balance: float) -> list[float] | None:
    """Draw weights count(answer)^-balance, so each answer's share of the draws goes as
    its count^(1-balance); None at 0 (no weighting: every prompt once per epoch)."""
    if balance == 0:
        return None
    counts = Counter(answers)
    return [counts[a] ** -balance for a in answers]


def draw_counts(weights: list[float], rng: random.Random) -> list[int]:
    """How often each of the n prompts comes in an epoch of n: the floor or the ceiling of
    its expected n*w/sum(w), the ceilings placed by systematic sampling (one random
    offset). Equal weights give every prompt exactly once: the plain epoch."""
    n, total = len(weights), sum(weights)
    expected = [n * w / total for w in weights]
    counts = [int(e) for e in expected]
    left = n - sum(counts)
    point, acc = rng.random(), 0.0
    for i, e in enumerate(expected):
        acc += e - counts[i]
        if left and point < acc:
            counts[i], point, left = counts[i] + 1, point + 1.0, left - 1
    if left:  # what float rounding left over goes to the largest remainders
        by_remainder = sorted(range(n), key=lambda i: counts[i] - expected[i])
        for i in by_remainder[:left]:
            counts[i] += 1
    return counts


def epoch_order(
    n: int, epoch: int, seed: int, shuffle: bool, weights: list[float] | None = None
) -> list[int]:
    """The order of the n prompts in one epoch (a fresh seeded shuffle per epoch); with
    `weights`, n prompts drawn by `draw_counts`. Both are a function of (seed, epoch): a
    resumed cursor finds the same order."""
    rng = random.Random(f"{seed}-{epoch}")
    if weights is None:
        order = list(range(n))
    else:
        order = [i for i, count in enumerate(draw_counts(weights, rng)) for _ in range(count)]
    if shuffle:
        rng.shuffle(order)
    return order


def iterate(
    records: list[PromptRecord], start: Cursor, seed: int, shuffle: bool, balance: float = 0.0
) -> Iterator[tuple[Cursor, PromptRecord]]:
    """Endless (epoch, record) stream from `start`; each item carries the cursor after it.
    `balance`: DatasetConfig.answer_balance."""
    if not records:
        raise DapoError("the dataset holds no prompts")
    weights = answer_weights([r.ground_truth for r in records], balance)
    epoch, index = start.epoch, start.index
    while True:
        order = epoch_order(len(records), epoch, seed, shuffle, weights)
        while index < len(order):
            record = records[order[index]]
            index += 1
            yield Cursor(epoch, index), record
        epoch, index = epoch + 1, 0
