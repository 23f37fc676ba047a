"""Prompt data: DAPO parquet/JSONL loaders, dedupe, writers and the synthetic tasks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from services.common.data import (
    SYNTHETIC_TASKS,
    DataError,
    PromptRecord,
    aime_path,
    load_jsonl,
    load_parquet,
    load_records,
    synthetic_records,
    unique_records,
    write_records,
)

AIME = aime_path()
needs_aime = pytest.mark.skipif(
    not AIME.is_file(), reason=f"AIME parquet not found at {AIME} (set DAPO_AIME_PARQUET)"
)
INSTRUCTION_START = "Solve the following math problem step by step."


def _expected_answer(task: str, prompt: str) -> str:
    """Recompute the gold answer from the prompt text, independently of the module."""
    assert prompt.endswith("=")
    digits = prompt[:-1].split(",")
    return {
        "max3": lambda: str(max(int(d) for d in digits)),
        "copy2": lambda: "".join(digits),
        "reverse2": lambda: "".join(reversed(digits)),
    }[task]()


# --------------------------------------------------------------------------- AIME


@needs_aime
def test_aime_parquet_parses_all_rows() -> None:
    records = load_records(AIME)
    assert len(records) == 960
    assert {r.data_source for r in records} == {"math_dapo"}
    for r in records:
        assert r.prompt.startswith(INSTRUCTION_START)
        assert r.raw_problem and r.raw_problem in r.prompt
        assert r.ground_truth.strip().lstrip("-").isdigit()
        assert r.messages == [{"role": "user", "content": r.prompt}]
        assert r.prompt_id == f"math_dapo-{r.index}"


@needs_aime
def test_aime_unique_keeps_one_per_problem() -> None:
    records = load_records(AIME, unique=True)
    assert len(records) == 30
    assert sorted(r.index for r in records) == list(range(30))
    assert len({r.prompt for r in records}) == 30
    assert len(load_records(AIME, unique=True, limit=5)) == 5
    # Each copy of a problem carries the same gold answer as the kept one.
    gold = {r.prompt_id: r.ground_truth for r in records}
    assert all(gold[r.prompt_id] == r.ground_truth for r in load_parquet(AIME))


@needs_aime
@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_aime_round_trip(tmp_path: Path, suffix: str) -> None:
    records = load_records(AIME, unique=True)
    path = write_records(records, tmp_path / f"aime{suffix}")
    assert load_records(path) == records


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_synthetic_round_trip(tmp_path: Path, suffix: str) -> None:
    records = synthetic_records("max3", 50, seed=1, split="test")
    path = write_records(records, tmp_path / "sub" / f"max3{suffix}")
    loaded = load_records(path)
    assert loaded == records
    assert loaded[0].split == "test" and loaded[0].ability == "synthetic"


def test_jsonl_is_dapo_rows(tmp_path: Path) -> None:
    path = write_records(synthetic_records("copy2", 3), tmp_path / "c.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 3
    row = rows[0]
    assert set(row) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
    assert row["prompt"] == [{"role": "user", "content": row["extra_info"]["raw_problem"]}]
    assert row["reward_model"]["ground_truth"] == _expected_answer(
        "copy2", row["prompt"][0]["content"]
    )


def test_jsonl_skips_blank_lines_and_keeps_last_user_turn(tmp_path: Path) -> None:
    row = {
        "data_source": "x",
        "prompt": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "1+1?"},
        ],
        "reward_model": {"ground_truth": 2},
    }
    path = tmp_path / "r.jsonl"
    path.write_text("\n" + json.dumps(row) + "\n\n")
    (record,) = load_jsonl(path)
    assert record.prompt == "1+1?" and record.ground_truth == "2"
    assert len(record.messages) == 2 and record.ability == ""
    assert record.prompt_id.startswith("x-") and len(record.prompt_id) == len("x-") + 12


def test_unique_records_custom_key() -> None:
    records = synthetic_records("max3", seed=0)
    by_answer = unique_records(records, key=lambda r: r.ground_truth)
    assert sorted(r.ground_truth for r in by_answer) == [str(d) for d in range(10)]
    assert unique_records(records + records) == records


# --------------------------------------------------------------------------- errors


def _assert_one_line(exc: pytest.ExceptionInfo[DataError], path: Path) -> None:
    message = str(exc.value)
    assert "\n" not in message and str(path) in message


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.parquet"
    with pytest.raises(DataError, match="data file not found") as exc:
        load_records(path)
    _assert_one_line(exc, path)


@pytest.mark.parametrize("name", ["data.csv", "data.json", "data"])
def test_wrong_extension(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    path.write_text("{}")
    with pytest.raises(DataError, match=r"unsupported extension .*expected \.parquet or \.jsonl"):
        load_records(path)
    with pytest.raises(DataError, match="unsupported extension"):
        write_records([], path)


def test_parquet_missing_columns(tmp_path: Path) -> None:
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"data_source": ["a"], "ability": ["b"]}), path)
    with pytest.raises(DataError, match="missing columns: prompt, reward_model") as exc:
        load_records(path)
    _assert_one_line(exc, path)


def test_corrupt_parquet(tmp_path: Path) -> None:
    path = tmp_path / "bad.parquet"
    path.write_bytes(b"not parquet\nat all")
    with pytest.raises(DataError, match="cannot read parquet") as exc:
        load_records(path)
    _assert_one_line(exc, path)


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("{not json", r":2: invalid JSON"),
        ("[1, 2]", r":2: expected a JSON object, got list"),
        ('{"data_source": "x", "prompt": []}', r":2: missing columns: reward_model"),
        (
            '{"data_source": "x", "prompt": [], "reward_model": {"ground_truth": "1"}}',
            r":2: column prompt must be a non-empty list",
        ),
        (
            '{"data_source": "x", "prompt": [{"role": "user"}], "reward_model": {}}',
            r":2: column prompt: messages need role and content",
        ),
        (
            '{"data_source": "x", "prompt": [{"role": "system", "content": "hi"}],'
            ' "reward_model": {"ground_truth": "1"}}',
            r":2: column prompt has no user message",
        ),
        (
            '{"data_source": "x", "prompt": [{"role": "user", "content": "q"}],'
            ' "reward_model": {"style": "rule"}}',
            r":2: column reward_model has no ground_truth",
        ),
    ],
)
def test_jsonl_bad_lines(tmp_path: Path, line: str, match: str) -> None:
    path = tmp_path / "bad.jsonl"
    good = json.dumps(synthetic_records("copy2", 1)[0].to_row())
    path.write_text(good + "\n" + line + "\n")
    with pytest.raises(DataError, match=match) as exc:
        load_records(path)
    _assert_one_line(exc, path)


def test_data_error_is_value_error() -> None:
    assert issubclass(DataError, ValueError)


# --------------------------------------------------------------------------- synthetic


@pytest.mark.parametrize(("task", "n_train", "n_test"), [("max3", 800, 200), ("copy2", 80, 20)])
def test_synthetic_splits_are_disjoint_and_complete(task: str, n_train: int, n_test: int) -> None:
    train = {r.prompt for r in synthetic_records(task, split="train")}
    test = {r.prompt for r in synthetic_records(task, split="test")}
    assert (len(train), len(test)) == (n_train, n_test)
    assert not train & test
    # The split does not depend on the run seed: other seeds never leak test prompts.
    assert {r.prompt for r in synthetic_records(task, split="test", seed=99)} == test


@pytest.mark.parametrize("task", sorted(SYNTHETIC_TASKS))
def test_synthetic_answers_are_correct(task: str) -> None:
    records = synthetic_records(task, split="train") + synthetic_records(task, split="test")
    for r in records:
        assert r.ground_truth == _expected_answer(task, r.prompt)
        assert r.data_source == f"synthetic_{task}" and r.raw_problem == r.prompt
    assert len({r.prompt_id for r in records}) == len(records)


@pytest.mark.parametrize(
    ("task", "prompt", "answer"),
    [("max3", "3,7,1=", "7"), ("copy2", "4,2=", "42"), ("reverse2", "4,2=", "24")],
)
def test_synthetic_examples(task: str, prompt: str, answer: str) -> None:
    records = synthetic_records(task, split="train") + synthetic_records(task, split="test")
    assert {r.prompt: r.ground_truth for r in records}[prompt] == answer


def test_synthetic_seeded_order() -> None:
    a = synthetic_records("max3", 20, seed=5)
    assert a == synthetic_records("max3", 20, seed=5)
    b = synthetic_records("max3", 20, seed=6)
    assert [r.prompt for r in a] != [r.prompt for r in b]
    assert len({r.prompt for r in a}) == 20
    assert synthetic_records("copy2", 0) == []


def test_synthetic_bad_arguments() -> None:
    with pytest.raises(ValueError, match="valid tasks: max3, copy2, reverse2"):
        synthetic_records("add2", 4)
    with pytest.raises(ValueError, match="valid splits: train, test"):
        synthetic_records("max3", 4, split="validation")
    with pytest.raises(ValueError, match="copy2/test has 20 prompts"):
        synthetic_records("copy2", 21, split="test")


def test_record_defaults_to_one_user_turn() -> None:
    record = PromptRecord("p", "1,2=", "12", "synthetic_copy2")
    assert record.messages == [{"role": "user", "content": "1,2="}]
    assert record.to_row()["prompt"] == record.messages


def test_data_module_is_torch_free(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from services.common.data import synthetic_records, write_records, load_records\n"
        f"p = write_records(synthetic_records('max3', 5), {str(tmp_path / 'x.parquet')!r})\n"
        "assert len(load_records(p)) == 5\n"
        "heavy = {'torch', 'transformers', 'tokenizers'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
