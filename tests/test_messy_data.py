"""Messy data never stalls `dapo up` (a soak over generated datasets, each run bounded).

Each dataset is written to tmp by the test and run for a few steps of the tiny preset. A
run either finishes, with the ledger accounting for every prompt (trained, filtered,
skipped at load or rejected, each with its reason), or exits non-zero within its bound
with one line saying why. Never a hang: every `dapo up` runs under a timeout.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest
from dapo_cli import DAPO, set_args
from messy_data import (
    HUGE_GROUND_TRUTH,
    OVERLONG,
    clean_rows,
    float_rows,
    messy_rows,
    row,
    system_model,
    system_rows,
    write_jsonl,
    write_parquet,
)

pytestmark = pytest.mark.slow
RUN_BOUND_S = 240  # a finishing run (2-3 tiny steps; minutes only on a loaded machine)
FAST_BOUND_S = 60  # data refused before any service starts: imports and the check only


def dapo_up(
    run_dir: Path, model: Path, data: Path, *extra: str, timeout: float = RUN_BOUND_S
) -> tuple[subprocess.CompletedProcess[str], float]:
    """`dapo up` on `data` (the tiny preset, no evaluation) and its wall time."""
    kind = "parquet" if data.suffix == ".parquet" else "jsonl"
    started = time.monotonic()
    settings = {
        "shared.model_path": model,
        "controller.eval.enabled": "false",
        "controller.dataset.kind": kind,
        "controller.dataset.path": data,
    }
    sets = set_args(f"{key}={value}" for key, value in settings.items())
    command = [*DAPO, "up", "--preset", "tiny"]
    command += ["--run-dir", str(run_dir), *sets, *extra]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    return result, time.monotonic() - started


def report_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "report.json").read_text())


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


def test_one_overlong_prompt_in_thirty_rows_finishes(tmp_path: Path, tiny_model: Path) -> None:
    """The issue's run: it stalled at step 26, retrying the overlong prompt forever."""
    rows = clean_rows(29)
    rows.insert(7, row(OVERLONG, "9", "long"))
    data = write_parquet(tmp_path / "one-long.parquet", rows)
    result, _ = dapo_up(tmp_path / "run", tiny_model, data, "--steps", "2")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "30 rows, 29 usable; skipped prompt_too_long 1" in result.stdout
    ledger = report_of(tmp_path / "run")["ledger"]
    assert ledger["ok"], ledger["problems"]
    assert ledger["dataset"] == {"rows": 30, "usable": 29, "filtered": {"prompt_too_long": 1}}
    assert ledger["rejected"] == {} and ledger["version"] == 2
    assert "prompts: 30 rows, 29 used; skipped at load: prompt_too_long 1" in result.stdout


def test_a_system_message_dataset_trains_with_its_system_turn(
    tmp_path: Path, tiny_model: Path
) -> None:
    """The model's template refuses a conversation without its system turn: the run trains
    only if the row's whole conversation reaches the engine (it once got the user turn)."""
    model = system_model(tiny_model, tmp_path / "model")
    data = write_jsonl(tmp_path / "system.jsonl", system_rows(30))
    chat = ("--set", "controller.apply_chat_template=true")
    result, _ = dapo_up(tmp_path / "run", model, data, *chat, "--steps", "2")
    assert result.returncode == 0, result.stderr[-2000:]
    ledger = report_of(tmp_path / "run")["ledger"]
    assert ledger["ok"], ledger["problems"]
    assert ledger["rejected"] == {} and ledger["trained"] >= 2 * 16


def test_a_float_ground_truth_parquet_trains(tmp_path: Path, tiny_model: Path) -> None:
    """A numeric ground-truth column (7.0, as pandas writes it) once never matched `7`:
    2,955 groups filtered all-wrong, 0 trained."""
    data = write_parquet(tmp_path / "floats.parquet", float_rows(30))
    result, _ = dapo_up(tmp_path / "run", tiny_model, data, "--steps", "2")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "30 rows, 30 usable; 30 float ground truths read as integers (3.0 → 3)" in (
        result.stdout
    )
    ledger = report_of(tmp_path / "run")["ledger"]
    assert ledger["ok"], ledger["problems"]
    assert ledger["trained"] >= 2 * 16 and ledger["version"] == 2


def test_every_prompt_too_long_exits_at_once_with_the_reason(
    tmp_path: Path, tiny_model: Path
) -> None:
    """The issue's other run: 0 steps in 196 s and no exit."""
    data = write_parquet(tmp_path / "all-long.parquet", [row(OVERLONG, "9", i) for i in range(30)])
    result, seconds = dapo_up(tmp_path / "run", tiny_model, data, timeout=FAST_BOUND_S)
    assert result.returncode == 2 and seconds < FAST_BOUND_S
    assert last_line(result.stderr) == (
        f"dapo up: error: every prompt was skipped at load: data {data}: 30 rows, 0 usable; "
        "skipped prompt_too_long 30 (> shared.max_prompt_length=16 tokens)"
    )
    assert not (tmp_path / "run" / "logs").exists()  # no service was started


def test_messy_data_trains_and_every_prompt_is_accounted_for(
    tmp_path: Path, tiny_model: Path
) -> None:
    rows, expected = messy_rows()
    data = write_parquet(tmp_path / "messy.parquet", rows)
    run_dir = tmp_path / "run"
    result, _ = dapo_up(run_dir, tiny_model, data, "--steps", "2")
    assert result.returncode == 0, result.stderr[-2000:]
    ledger = report_of(run_dir)["ledger"]
    assert ledger["ok"], ledger["problems"]  # admitted = trained + ... + rejected + in flight
    assert ledger["dataset"] == {
        "rows": expected.rows,
        "usable": expected.usable,
        "filtered": expected.skipped,
    }
    # The huge ground truth reaches the reward service, which refuses it for good: its
    # groups are rejected with the reason (once per admission), never retried.
    assert set(ledger["rejected"]) == expected.rejected_reasons
    assert ledger["trained"] >= 2 * 16
    assert "rejected groups (refused for good, not retried): ground_truth_too_long" in (
        result.stdout
    )
    retried = [
        line
        for line in (run_dir / "logs" / "controller.log").read_text().splitlines()
        if "retrying" in line and "INVALID_ARGUMENT" in line
    ]
    assert not retried, retried[:3]


@pytest.mark.parametrize(
    ("name", "defect", "message"),
    [
        ("missing-field", "missing", r"{data}:4: column reward_model has no ground_truth"),
        (
            "one-id-two-prompts",
            "conflict",
            r"{data} rows 1 and 5: prompt id 'messy-1' names two different prompts .*",
        ),
        (
            "all-empty",
            "empty",
            r"every prompt was skipped at load: data {data}: 3 rows, 0 usable; skipped "
            r"empty_prompt 3",
        ),
    ],
)
def test_unusable_data_exits_before_any_service_starts(
    tmp_path: Path, tiny_model: Path, name: str, defect: str, message: str
) -> None:
    rows = clean_rows(5)
    if defect == "missing":
        del rows[3]["reward_model"]["ground_truth"]
    elif defect == "conflict":
        rows.append(row("9,9,8=", "9", "1"))
    else:
        rows = [row(text, "1", i) for i, text in enumerate(["", "  ", "αβγ"])]
    data = write_jsonl(tmp_path / f"{name}.jsonl", rows)
    result, seconds = dapo_up(tmp_path / "run", tiny_model, data, timeout=FAST_BOUND_S)
    assert result.returncode == 2 and seconds < FAST_BOUND_S
    expected = "dapo up: error: " + message.format(data=re.escape(str(data)))
    assert re.fullmatch(expected, last_line(result.stderr)), result.stderr[-1000:]
    assert not (tmp_path / "run" / "logs").exists()


def test_a_run_whose_every_group_is_rejected_stops_with_the_reason(
    tmp_path: Path, tiny_model: Path
) -> None:
    """Ground truths the reward service refuses pass the load-time check (the limit is the
    reward's); every group is rejected, and the run stops itself instead of hanging."""
    rows = [
        row(r["prompt"][0]["content"], HUGE_GROUND_TRUTH, i) for i, r in enumerate(clean_rows(8))
    ]
    data = write_parquet(tmp_path / "huge-truths.parquet", rows)
    run_dir = tmp_path / "run"
    result, _ = dapo_up(
        run_dir, tiny_model, data, "--steps", "2", "--set", "controller.max_rejected_in_a_row=24"
    )
    assert result.returncode == 1, result.stderr[-2000:]
    assert re.fullmatch(
        r"dapo up: error: the last \d+ groups were all rejected \(ground_truth_too_long \d+\), "
        r"none scored; e\.g\. item 0: ground_truth has 20000 characters > "
        r"reward\.max_ground_truth_chars=10000",
        last_line(result.stderr),
    ), result.stderr[-2000:]
    ledger = report_of(run_dir)["ledger"]
    assert ledger["ok"], ledger["problems"]
    assert ledger["rejected"]["ground_truth_too_long"] >= 24 and ledger["trained"] == 0


def test_a_run_that_trains_nothing_shows_why_and_stops_at_the_stall_timeout(
    tmp_path: Path, tiny_model: Path
) -> None:
    """No answer can ever be right (words, under a first-integer verifier): every group is
    all-wrong and filtered, nothing is refused, no step completes. The bar says so with
    the counts, and `--stall-timeout` stops the run with them."""
    rows = [row(r["prompt"][0]["content"], "seven", i) for i, r in enumerate(clean_rows(8))]
    data = write_parquet(tmp_path / "unanswerable.parquet", rows)
    result, _ = dapo_up(
        tmp_path / "run", tiny_model, data, "--stall-after", "1", "--stall-timeout", "15"
    )
    assert result.returncode == 1, result.stderr[-2000:]
    assert re.fullmatch(
        r"dapo up: error: no training step for 1\ds \(--stall-timeout\): .*groups admitted "
        r"\d+, in flight \d+, rejected 0, filtered \d+, waiting to train 0",
        last_line(result.stderr),
    ), result.stderr[-2000:]
    assert re.search(r"^no training step for \d+s: .*groups admitted", result.stdout, re.M)
    assert report_of(tmp_path / "run")["ledger"]["trained"] == 0
