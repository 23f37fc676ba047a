"""Training data validated and screened at load: errors that name the file, row and column,
prompts too long for `shared.max_prompt_length` (after the chat template, counted as the
rollout server counts them) or empty skipped and counted, data with nothing left refused."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import redis
from dapo_cli import dapo
from messy_data import OVERLONG, clean_rows, messy_rows, row, write_jsonl, write_parquet
from transformers import AutoTokenizer

from services.common.data import DataError, PromptRecord, aime_path
from services.common.data_screen import check_ids, screen
from services.common.errors import DapoError
from services.common.prompt_tokens import CounterUnavailable, prompt_counter
from services.controller.config import DatasetConfig
from services.controller.dataset import load_training_data

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


def server_count(tokenizer, prompt: str, chat: bool) -> int:
    """The rollout server's count (rollout/server.py, `_prompt_ids`)."""
    if chat:
        messages = [{"role": "user", "content": prompt}]
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return len(ids)
    return len(tokenizer.encode(prompt, add_special_tokens=False))


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


@pytest.mark.parametrize("chat", [False, True])
def test_counts_match_the_rollout_servers(
    tiny_model: Path, small_tokenizer_dirs: list[Path], chat: bool
) -> None:
    for model in [tiny_model, *small_tokenizer_dirs]:
        tokenizer = AutoTokenizer.from_pretrained(model)
        count = prompt_counter(model, chat)
        for prompt in MESSY_PROMPTS:
            assert count(prompt) == server_count(tokenizer, prompt, chat), (model, prompt)


def test_no_counter_without_a_tokenizer(tmp_path: Path, tiny_model: Path) -> None:
    with pytest.raises(CounterUnavailable, match="tokenizer.json not found"):
        prompt_counter(tmp_path, chat=False)
    with pytest.raises(CounterUnavailable, match="no model path"):
        prompt_counter(None, chat=False)
    shutil.copy(tiny_model / "tokenizer.json", tmp_path / "tokenizer.json")
    assert prompt_counter(tmp_path, chat=False)("3,7,1=") == 6
    with pytest.raises(DataError, match="has no chat template"):
        prompt_counter(tmp_path, chat=True)


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
    data = screen(records, "F", prompt_counter(tiny_model, chat=False), 16)
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
    unchecked = screen(records, "F", None, 16)  # no tokenizer: only empty text is known
    assert unchecked.filtered == {"empty_prompt": 1} and not unchecked.counted
    assert "prompt lengths not checked" in unchecked.describe()


def test_one_id_for_two_prompts_is_an_error_repeats_are_not() -> None:
    check_ids([record("1,2,3=", 0), record("1,2,3=", 0)], "F")  # a repeated problem
    with pytest.raises(DataError, match=r"F rows 0 and 2: prompt id 's-0' names two"):
        check_ids([record("1,2,3=", 0), record("4,5,6=", 1), record("7,8,9=", 0)], "F")
    with pytest.raises(DataError, match="rows 0 and 1"):  # same prompt, another answer
        check_ids([record("1,2,3=", 0, "3"), record("1,2,3=", 0, "4")], "F")


def dataset(path: Path) -> DatasetConfig:
    kind = "parquet" if path.suffix == ".parquet" else "jsonl"
    return DatasetConfig(kind=kind, path=str(path))


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_messy_data_loads_screened(tmp_path: Path, tiny_model: Path, suffix: str) -> None:
    rows, expected = messy_rows()
    write = write_parquet if suffix == ".parquet" else write_jsonl
    path = write(tmp_path / f"messy{suffix}", rows)
    data = load_training_data(dataset(path), 0, str(tiny_model), False, 16)
    assert data.rows == expected.rows and data.filtered == expected.skipped
    assert len(data.records) == expected.usable
    golds = {r.prompt_id: r.ground_truth for r in data.records}
    assert golds["messy-latex"] == "\\frac{4}{2}" and golds["messy-unicode"] == "七"


def test_an_integer_ground_truth_is_its_string(tmp_path: Path, tiny_model: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [row("3,7,1=", 7, 0)])
    (record_,) = load_training_data(dataset(path), 0, str(tiny_model), False, 16).records
    assert record_.ground_truth == "7"


def error_of(cfg: DatasetConfig, model: Path | None = None) -> str:
    with pytest.raises(DapoError) as raised:
        load_training_data(cfg, 0, str(model) if model else None, False, 16)
    message = str(raised.value)
    assert "\n" not in message
    return message


def test_errors_name_the_file_row_and_column(tmp_path: Path) -> None:
    rows = clean_rows(4)
    del rows[2]["reward_model"]["ground_truth"]
    jsonl = write_jsonl(tmp_path / "d.jsonl", rows)
    assert error_of(dataset(jsonl)) == f"{jsonl}:3: reward_model has no ground_truth"
    rows = clean_rows(4)
    rows[1]["prompt"] = None
    parquet = write_parquet(tmp_path / "d.parquet", rows)
    assert error_of(dataset(parquet)).startswith(f"{parquet} row 1: prompt must be")
    no_column = write_parquet(tmp_path / "n.parquet", [{"data_source": "s", "prompt": []}])
    assert error_of(dataset(no_column)) == f"{no_column}: missing columns: reward_model"
    assert error_of(DatasetConfig(kind="parquet")) == (
        "controller.dataset.path is required for kind=parquet"
    )
    assert "data file not found" in error_of(dataset(tmp_path / "absent.parquet"))


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
    model = str(small_tokenizer_dirs[1])
    assert load_training_data(cfg, 0, model, True, 2048).filtered == {}
    count = prompt_counter(model, chat=True)
    lengths = sorted(
        {count(r.prompt) for r in load_training_data(cfg, 0, model, True, 2048).records}
    )
    limit = lengths[len(lengths) // 2]
    data = load_training_data(cfg, 0, model, True, limit)
    longer = sum(1 for r in data.records if count(r.prompt) > limit)
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
    assert result.stderr.strip().endswith(
        f"data {good}: 4 rows, 3 usable; skipped prompt_too_long 1 "
        "(> shared.max_prompt_length=16 tokens)"
    )
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
