"""Generated training data with the defects real datasets have (no real data).

Rows are DAPO-format dicts (services/common/data.py) around max3 prompts the tiny model can
answer; the defects are mixed in at fixed positions so a test knows what to expect of each
file: overlong, empty and unknown-character prompts, non-numeric / LaTeX / unicode / huge
ground truths, repeated rows (the same id and content), an integer ground truth, and,
in files of their own, a row with a missing field and an id given to two prompts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from services.common.data import synthetic_records

OVERLONG = "1,2,3,4,5,6,7,8,9,0,1,2,3="  # 26 characters: the tiny model's 16-token limit
HUGE_GROUND_TRUTH = "9" * 20_000  # past reward.max_ground_truth_chars (10,000)


def row(prompt: str, ground_truth: Any, index: Any) -> dict[str, Any]:
    return {
        "data_source": "messy",
        "prompt": [{"content": prompt, "role": "user"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": ground_truth, "style": "rule"},
        "extra_info": {"index": index},
    }


def clean_rows(n: int, start: int = 0) -> list[dict[str, Any]]:
    """`n` max3 problems with their answers, indices from `start`."""
    records = synthetic_records("max3", split="test")[start : start + n]
    return [row(r.prompt, r.ground_truth, str(start + i)) for i, r in enumerate(records)]


@dataclass
class Expected:
    """What loading a file must report: rows, and rows skipped at load by reason."""

    rows: int
    skipped: dict[str, int] = field(default_factory=dict)
    rejected_reasons: set[str] = field(default_factory=set)  # may appear in the ledger

    @property
    def usable(self) -> int:
        return self.rows - sum(self.skipped.values())


def messy_rows() -> tuple[list[dict[str, Any]], Expected]:
    """A dataset that must train: every defect that is not an error, mixed in."""
    rows = clean_rows(20)
    rows += [row(OVERLONG, "9", "long-1"), row(OVERLONG + "4", "9", "long-2")]
    rows += [row("", "1", "empty-1"), row("   ", "1", "empty-2")]
    rows += [row("αβγ", "1", "unknown-chars")]  # no character the tiny tokenizer knows
    rows += [
        row("3,1,2=", "three", "words"),
        row("1,2,1=", "\\frac{4}{2}", "latex"),
        row("7,0,0=", "七", "unicode"),
        row("5,5,4=", "5 \\text{ apples} ∎", "latex-unicode"),
        row("9,1,9=", HUGE_GROUND_TRUTH, "huge"),
    ]
    rows += [rows[0], rows[1], rows[2]]  # repeats: same id, same content
    expected = Expected(
        rows=len(rows),
        skipped={"prompt_too_long": 2, "empty_prompt": 3},
        rejected_reasons={"ground_truth_too_long"},
    )
    return rows, expected


def write_parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    """Rows as a parquet file (pyarrow infers the schema; ground truths must share a type)."""
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return path


SYSTEM = "9,9="  # a system turn the tiny tokenizer can spell
# Renders every turn, and refuses a conversation without its system turn: a prompt path
# that drops the system message fails instead of training on the user turn alone.
SYSTEM_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}"
    "{{ raise_exception('this model needs its system turn') }}{% endif %}"
    "{% for message in messages %}{{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
)


def system_model(model: Path, out: Path) -> Path:
    """A copy of the tiny model whose chat template needs the system turn."""
    import shutil

    shutil.copytree(model, out)
    (out / "chat_template.jinja").write_text(SYSTEM_TEMPLATE)
    return out


def system_rows(n: int) -> list[dict[str, Any]]:
    """`clean_rows(n)` with a system message before each user turn."""
    rows = clean_rows(n)
    for r in rows:
        r["prompt"] = [{"role": "system", "content": SYSTEM}, *r["prompt"]]
    return rows


def float_rows(n: int) -> list[dict[str, Any]]:
    """max3 rows whose ground truth column is numeric, as pandas writes it (7 → 7.0)."""
    rows = clean_rows(n)
    for r in rows:
        r["reward_model"]["ground_truth"] = float(r["reward_model"]["ground_truth"])
    return rows
