"""Training data validated and screened at load: errors that name the file, row and column,
prompts too long for `shared.max_prompt_length` (the whole conversation through the model's
own tokenizer and chat template, once) or empty skipped and counted, data with nothing
left refused; what a careful user would notice warned of."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import redis
from dapo_cli import dapo
from messy_data import (
    OVERLONG,
    clean_rows,
    float_rows,
    messy_rows,
    row,
    write_jsonl,
    write_parquet,
)
from transformers import AutoTokenizer

from services.common.data import DataError, PromptRecord, aime_path
from services.common.data_screen import check_ids, screen
from services.common.errors import DapoError
from services.common.tokenizer import PromptTokenizer, load_tokenizer
from services.controller.config import DatasetConfig
from services.controller.dataset import load_eval_data, load_training_data

MESSY_PROMPTS = [
    "3,7,1=",
    OVERLONG,
    "",
    "αβγ",
    "Solve $\\frac{1}{2} + x = 3$ for x. 答えは？ 🙂",
    "<|im_end|> not a real end",
    "line one\nline two\n\n  indented",
]
QWEN_LIKE_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]"
    "['content'] + '<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are a helpful "
    "assistant.<|im_end|>\\n' }}{%- endif %}{%- for message in messages %}{%- if "
    "message.role != 'system' %}{{- '<|im_start|>' + message.role + '\\n' + message.content "
    "+ '<|im_end|>' + '\\n' }}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def small_tokenizer_dirs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """The small preset's BPE tokenizer with its ChatML template, and with a Qwen2.5-like
    template (a default system turn, `-` whitespace control)."""
    from learner.init_model import build_small_tokenizer

    tokenizer = build_small_tokenizer()
    own = tmp_path_factory.mktemp("small-tok")
    tokenizer.save_pretrained(own)
    tokenizer.chat_template = QWEN_LIKE_TEMPLATE
    qwen = tmp_path_factory.mktemp("qwen-like-tok")
    tokenizer.save_pretrained(qwen)
    return [own, qwen]


CONVERSATION = [
    {"role": "system", "content": "Answer with one number."},
    {"role": "user", "content": "Solve $\\frac{1}{2} + x = 3$ for x. 答えは？"},
    {"role": "assistant", "content": "x = 2.5"},
    {"role": "user", "content": "Again, for 4."},
]


def test_the_prompt_is_the_whole_conversation_through_the_models_template(
    small_tokenizer_dirs: list[Path],
) -> None:
    """Every turn, the system's included, in the ids; they are transformers' own."""
    for model in small_tokenizer_dirs:
        ours = load_tokenizer(model, chat=True)
        theirs = AutoTokenizer.from_pretrained(model)
        text = theirs.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=False)
        ids = ours.ids(CONVERSATION)
        assert ours.render(CONVERSATION) == text and "Answer with one number." in text
        assert theirs.decode(ids) == text  # byte for byte
        assert ids == theirs.encode(text, add_special_tokens=False)


def test_a_model_without_a_tokenizer_or_template_is_one_line(
    tmp_path: Path, tiny_model: Path
) -> None:
    for path, words in [
        (None, "shared.model_path is not set"),
        (tmp_path / "absent", "model directory not found"),
        (tmp_path, "cannot load its tokenizer"),
    ]:
        with pytest.raises(DapoError, match=words) as raised:
            load_tokenizer(path, chat=False)
        assert "\n" not in str(raised.value)
    shutil.copy(tiny_model / "tokenizer.json", tmp_path / "tokenizer.json")
    assert load_tokenizer(tmp_path, chat=False).ids([{"role": "user", "content": "3,7,1="}])
    with pytest.raises(DapoError, match="has no chat template"):
        load_tokenizer(tmp_path, chat=True)


def test_raw_prompts_are_one_user_turn(tiny_model: Path) -> None:
    raw = load_tokenizer(tiny_model, chat=False)
    with pytest.raises(ValueError, match="apply_chat_template is false"):
        raw.ids(CONVERSATION)


def record(prompt: str, index: int, gold: str = "1") -> PromptRecord:
    return PromptRecord(f"s-{index}", prompt, gold, "s", index=index)


def test_screen_skips_and_counts_empty_and_overlong_prompts(tiny_model: Path) -> None:
    records = [
        record("3,7,1=", 0),
        record(OVERLONG, 1),
        record(" ", 2),
        record("αβγ", 3),
        record("1,2,3=", 4),
        record(OVERLONG, 5),
    ]
    data = screen(records, "F", load_tokenizer(tiny_model, chat=False), 16)
    assert [r.prompt_id for r in data.records] == ["s-0", "s-4"]
    assert data.filtered == {"prompt_too_long": 2, "empty_prompt": 2}
    assert data.counts() == {
        "rows": 6,
        "usable": 2,
        "filtered:prompt_too_long": 2,
        "filtered:empty_prompt": 2,
    }
    assert data.describe() == (
        "data F: 6 rows, 2 usable; skipped empty_prompt 2, prompt_too_long 2 "
        "(> shared.max_prompt_length=16 tokens)"
    )
    assert all(r.prompt_token_ids for r in data.records)  # tokenized once, here


def test_one_id_for_two_prompts_is_an_error_repeats_are_not() -> None:
    check_ids([record("1,2,3=", 0), record("1,2,3=", 0)], "F")  # a repeated problem
    with pytest.raises(DataError, match=r"F rows 0 and 2: prompt id 's-0' names two"):
        check_ids([record("1,2,3=", 0), record("4,5,6=", 1), record("7,8,9=", 0)], "F")
    with pytest.raises(DataError, match="rows 0 and 1"):  # same prompt, another answer
        check_ids([record("1,2,3=", 0, "3"), record("1,2,3=", 0, "4")], "F")


def tokenizer_of(model: Path) -> PromptTokenizer:
    return load_tokenizer(model, chat=False)


def dataset(path: Path) -> DatasetConfig:
    kind = "parquet" if path.suffix == ".parquet" else "jsonl"
    return DatasetConfig(kind=kind, path=str(path))


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_messy_data_loads_screened(tmp_path: Path, tiny_model: Path, suffix: str) -> None:
    rows, expected = messy_rows()
    write = write_parquet if suffix == ".parquet" else write_jsonl
    path = write(tmp_path / f"messy{suffix}", rows)
    data = load_training_data(dataset(path), 0, tokenizer_of(tiny_model), 16)
    assert data.rows == expected.rows and data.filtered == expected.skipped
    assert len(data.records) == expected.usable
    golds = {r.prompt_id: r.ground_truth for r in data.records}
    assert golds["messy-latex"] == "\\frac{4}{2}" and golds["messy-unicode"] == "七"


def test_an_integer_ground_truth_is_its_string(tmp_path: Path, tiny_model: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [row("3,7,1=", 7, 0)])
    (record_,) = load_training_data(dataset(path), 0, tokenizer_of(tiny_model), 16).records
    assert record_.ground_truth == "7"


def error_of(cfg: DatasetConfig, model: Path) -> str:
    with pytest.raises(DapoError) as raised:
        load_training_data(cfg, 0, tokenizer_of(model), 16)
    message = str(raised.value)
    assert "\n" not in message
    return message


def test_errors_name_the_file_row_and_column(tmp_path: Path, tiny_model: Path) -> None:
    rows = clean_rows(4)
    del rows[2]["reward_model"]["ground_truth"]
    jsonl = write_jsonl(tmp_path / "d.jsonl", rows)
    assert (
        error_of(dataset(jsonl), tiny_model)
        == f"{jsonl}:3: column reward_model has no ground_truth"
    )
    rows = clean_rows(4)
    rows[1]["prompt"] = None
    parquet = write_parquet(tmp_path / "d.parquet", rows)
    assert error_of(dataset(parquet), tiny_model).startswith(
        f"{parquet} row 1: column prompt must be"
    )
    no_column = write_parquet(tmp_path / "n.parquet", [{"data_source": "s", "prompt": []}])
    assert error_of(dataset(no_column), tiny_model) == f"{no_column}: missing columns: reward_model"
    assert error_of(DatasetConfig(kind="parquet"), tiny_model) == (
        "controller.dataset.path is required for kind=parquet"
    )
    assert "data file not found" in error_of(dataset(tmp_path / "absent.parquet"), tiny_model)


def test_data_with_nothing_left_is_refused(tmp_path: Path, tiny_model: Path) -> None:
    rows = [row(OVERLONG, "9", i) for i in range(30)]
    path = write_parquet(tmp_path / "d.parquet", rows)
    assert error_of(dataset(path), tiny_model) == (
        f"every prompt was skipped at load: data {path}: 30 rows, 0 usable; skipped "
        "prompt_too_long 30 (> shared.max_prompt_length=16 tokens)"
    )
    empty = write_jsonl(tmp_path / "e.jsonl", [])
    assert error_of(dataset(empty), tiny_model) == f"{empty}: the dataset holds no prompts"


@pytest.mark.skipif(not aime_path().is_file(), reason=f"no AIME parquet at {aime_path()}")
def test_aime_with_a_real_template_fits_the_papers_prompt_length(
    small_tokenizer_dirs: list[Path],
) -> None:
    """The AIME file through a Qwen-like chat template: every prompt fits the paper's
    2048 tokens; with a limit below the longest, exactly the longer ones are skipped."""
    cfg = dataset(aime_path())
    tokenizer = load_tokenizer(small_tokenizer_dirs[1], chat=True)
    assert load_training_data(cfg, 0, tokenizer, 2048).filtered == {}
    records = load_training_data(cfg, 0, tokenizer, 2048).records
    lengths = sorted({len(r.prompt_token_ids) for r in records})
    limit = lengths[len(lengths) // 2]
    data = load_training_data(cfg, 0, tokenizer, limit)
    longer = sum(1 for r in data.records if len(r.prompt_token_ids) > limit)
    assert longer == 0 and data.filtered["prompt_too_long"] > 0
    assert len(data.records) + data.filtered["prompt_too_long"] == data.rows == 960


def test_config_show_check_data(tmp_path: Path, tiny_model: Path) -> None:
    rows = clean_rows(3)
    del rows[1]["reward_model"]
    bad = write_jsonl(tmp_path / "bad.jsonl", rows)
    base = ("config", "show", "--check-data", "--preset", "tiny")
    base += ("--set", f"shared.model_path={tiny_model}", "--set", "controller.dataset.kind=jsonl")
    result = dapo(*base, "--set", f"controller.dataset.path={bad}")
    assert result.returncode == 2
    # the last line (a warning about the missing held-out data may come before it)
    error = f"dapo config: error: {bad}:2: missing columns: reward_model"
    assert result.stderr.strip().splitlines()[-1] == error
    good = write_jsonl(tmp_path / "good.jsonl", [*clean_rows(3), row(OVERLONG, "1", "x")])
    result = dapo(*base, "--set", f"controller.dataset.path={good}")
    assert result.returncode == 0, result.stderr
    assert (
        f"data {good}: 4 rows, 3 usable; skipped prompt_too_long 1 "
        "(> shared.max_prompt_length=16 tokens)"
    ) in result.stderr
    no_path = dapo("config", "show", "--check-data", "--set", "controller.dataset.kind=parquet")
    assert no_path.returncode == 2
    assert no_path.stderr.strip().splitlines()[-1] == (
        "dapo config: error: controller.dataset.path is required for kind=parquet"
    )


def test_held_out_prompts_a_server_would_refuse_are_skipped(
    tmp_path: Path, tiny_model: Path, redis_client: redis.Redis
) -> None:
    """A refused held-out prompt would fail every point of the eval curve."""
    from services.controller.evaluation import screened_eval_records
    from services.controller.server import Controller
    from services.tools.config import load_config

    path = write_parquet(tmp_path / "eval.parquet", [*clean_rows(3), row(OVERLONG, "1", "x")])
    config = load_config(preset="tiny", env={}, overrides=[f"shared.model_path={tiny_model}"])
    records = screened_eval_records(Controller(config, redis_client), str(path))
    assert [r.prompt_id for r in records] == ["messy-0", "messy-1", "messy-2"]


# -- data checked as a careful user checks it ------------------------------------------------


def test_integral_float_ground_truths_are_integers_and_counted(
    tmp_path: Path, tiny_model: Path
) -> None:
    rows = float_rows(4)
    rows[3]["reward_model"]["ground_truth"] = 2.5  # not integral: kept as written
    path = write_parquet(tmp_path / "floats.parquet", rows)
    data = load_training_data(dataset(path), 0, tokenizer_of(tiny_model), 16)
    golds = [r.ground_truth for r in data.records]
    assert golds[:3] == [r["reward_model"]["ground_truth"] for r in clean_rows(3)]
    assert golds[3] == "2.5" and all(".0" not in g for g in golds)
    assert data.describe().endswith("; 3 float ground truths read as integers (3.0 → 3)")
    assert data.counts()["normalised:float_ground_truth_normalised"] == 3


def test_a_kind_that_does_not_read_the_path_is_an_error(tmp_path: Path, tiny_model: Path) -> None:
    jsonl = write_jsonl(tmp_path / "d.jsonl", clean_rows(3))
    synthetic = DatasetConfig(kind="synthetic", path=str(jsonl))
    assert error_of(synthetic, tiny_model) == (
        f"controller.dataset.path is {jsonl} but controller.dataset.kind is synthetic, which "
        "reads no file; set kind=parquet or kind=jsonl"
    )
    wrong = DatasetConfig(kind="parquet", path=str(jsonl))
    assert error_of(wrong, tiny_model) == (
        f"controller.dataset.kind is parquet but {jsonl} is a .jsonl file; set kind to match "
        "the file (parquet, jsonl)"
    )


@pytest.mark.parametrize(
    ("column", "value", "words"),
    [
        ("reward_model", "3", 'column reward_model must be an object such as {"ground_truth"'),
        ("extra_info", 7, "column extra_info must be an object"),
        ("prompt", "3,7,1=", "column prompt must be a non-empty list"),
    ],
)
def test_a_malformed_row_is_one_line_naming_file_row_and_column(
    tmp_path: Path, tiny_model: Path, column: str, value: object, words: str
) -> None:
    rows = clean_rows(3)
    rows[1][column] = value
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    message = error_of(dataset(path), tiny_model)
    assert message.startswith(f"{path}:2: {words}"), message


def test_an_empty_ground_truth_is_skipped_and_counted(tmp_path: Path, tiny_model: Path) -> None:
    rows = clean_rows(3)
    rows[0]["reward_model"]["ground_truth"] = ""
    rows[2]["reward_model"]["ground_truth"] = "  "
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    data = load_training_data(dataset(path), 0, tokenizer_of(tiny_model), 16)
    assert [r.prompt_id for r in data.records] == ["messy-1"]
    assert data.filtered == {"empty_ground_truth": 2}


def test_a_verifier_that_cannot_score_the_ground_truths_is_warned_of(
    tmp_path: Path, tiny_model: Path
) -> None:
    rows = clean_rows(6)
    for r in rows[:4]:
        r["reward_model"]["ground_truth"] = "\\frac{3}{4}"
    path = write_jsonl(tmp_path / "latex.jsonl", rows)
    cfg, tokenizer = dataset(path), tokenizer_of(tiny_model)
    (warning,) = load_training_data(cfg, 0, tokenizer, 16, "first_integer").warnings
    assert warning.startswith("shared.verifier is first_integer but 4 of 6 sampled ground truths")
    assert "'\\\\frac{3}{4}'" in warning
    assert load_training_data(cfg, 0, tokenizer, 16, "math_verify").warnings == []
    integers = write_jsonl(tmp_path / "ints.jsonl", clean_rows(6))
    assert load_training_data(dataset(integers), 0, tokenizer, 16, "first_integer").warnings == []


def test_a_tokenizer_that_drops_characters_is_warned_of(tmp_path: Path, tiny_model: Path) -> None:
    """The tiny tokenizer knows digits and `,=+`: a worded problem keeps a few tokens."""
    worded = "Find the largest of the following three digits and answer with it alone: " * 3
    path = write_jsonl(
        tmp_path / "d.jsonl", [row(worded + "3,7,1=", "7", "worded"), *clean_rows(2)]
    )
    data = load_training_data(dataset(path), 0, tokenizer_of(tiny_model), 16)
    (warning,) = data.warnings
    assert warning.startswith("1 of 3 prompts keep far fewer tokens than their characters")
    assert f"(e.g. {len(worded) + 6} characters → 6 tokens)" in warning


def test_eval_data_that_is_training_data_is_warned_of(tmp_path: Path, tiny_model: Path) -> None:
    tokenizer = tokenizer_of(tiny_model)
    train_path = write_jsonl(tmp_path / "train.jsonl", clean_rows(6))
    train = load_training_data(dataset(train_path), 0, tokenizer, 16).records
    same = load_eval_data(str(train_path), None, tokenizer, 16, (train, str(train_path)))
    assert same.warnings == [
        f"controller.eval.data is the training data ({train_path}): not held out"
    ]
    partly = write_jsonl(tmp_path / "eval.jsonl", clean_rows(4, start=4))
    overlap = load_eval_data(str(partly), None, tokenizer, 16, (train, str(train_path)))
    assert overlap.warnings == [
        f"2 of 4 eval prompts in {partly} are also training prompts in {train_path}: "
        "the eval is not held out"
    ]
    apart = write_jsonl(tmp_path / "apart.jsonl", clean_rows(4, start=6))
    assert load_eval_data(str(apart), None, tokenizer, 16, (train, str(train_path))).warnings == []


def test_check_data_checks_the_eval_data_too(tmp_path: Path, tiny_model: Path) -> None:
    train = write_jsonl(tmp_path / "train.jsonl", clean_rows(3))
    base = ("config", "show", "--check-data", "--preset", "tiny")
    base += ("--set", f"shared.model_path={tiny_model}", "--set", "controller.dataset.kind=jsonl")
    base += ("--set", f"controller.dataset.path={train}")
    missing = tmp_path / "absent.parquet"
    result = dapo(*base, "--set", f"controller.eval.data={missing}")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        f"dapo config: error: {missing}: data file not found"
    )
    result = dapo(*base, "--set", f"controller.eval.data={train}")
    assert result.returncode == 0, result.stderr
    assert f"eval data {train}: 3 rows, 3 usable" in result.stderr
    assert (
        f"dapo config: warning: controller.eval.data is the training data ({train}): not held out"
    ) in result.stderr
