"""The reasoning tasks (runmax, runsum): generator, gold answers, the `dapo` rule, splits."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from pathlib import Path

import pytest
from dapo_cli import run_ok, set_args

from reward.verifiers import verify_dapo
from services.common.data import SYNTHETIC_NAMES, iter_synthetic_corpus, synthetic_records
from services.common.reasoning import (
    ANSWER_PREFIX,
    REASONING_TASKS,
    gold_response,
    parse_prompt,
    prompt_pool,
)
from services.tools.cli import up_argv
from services.tools.task_probe import on_correct_path, profile

TASKS = sorted(REASONING_TASKS)


def _all(task: str) -> list:
    return synthetic_records(task, split="train") + synthetic_records(task, split="test")


def test_reasoning_tasks_are_synthetic_names() -> None:
    assert set(REASONING_TASKS) <= set(SYNTHETIC_NAMES)


@pytest.mark.parametrize("task", TASKS)
def test_lengths_vary_and_the_reference_grows_with_the_prompt(task: str) -> None:
    spec = REASONING_TASKS[task]
    records = _all(task)
    lengths = Counter(len(parse_prompt(r.prompt)) for r in records)
    assert set(lengths) == set(range(spec.min_len, spec.max_len + 1))
    assert lengths[2] == 100  # every 2-digit list; longer ones are a fixed draw
    assert all(
        spec.per_length // 2 < lengths[k] <= spec.per_length for k in range(3, spec.max_len + 1)
    )
    for record in records[:200]:
        digits = parse_prompt(record.prompt)
        scratchpad, answer_line = gold_response(task, digits).split("\n")
        assert len(scratchpad.split(",")) == len(digits)  # one step per digit
        assert answer_line == f"{ANSWER_PREFIX}{record.ground_truth}"


def test_gold_answers_are_the_running_folds() -> None:
    assert gold_response("runmax", (3, 7, 1, 4)) == "3,7,7,7\nAnswer: 7"
    assert gold_response("runsum", (3, 5, 2)) == "3,8,10\nAnswer: 10"
    for record in _all("runmax"):
        assert record.ground_truth == str(max(parse_prompt(record.prompt)))
    for record in _all("runsum"):
        assert record.ground_truth == str(sum(parse_prompt(record.prompt)))
    assert {r.data_source for r in _all("runmax")} == {"synthetic_runmax"}


def test_runmax_answers_are_not_mostly_nine() -> None:
    # With uniform digits the maximum of a 5-digit list is 9 41% of the time: a policy
    # that always answers 9 would sit in that optimum. The draw balances the maximum.
    answers = Counter(r.ground_truth for r in _all("runmax"))
    assert set(answers) == set("0123456789")
    assert answers["9"] / sum(answers.values()) < 0.2


@pytest.mark.parametrize("task", TASKS)
def test_dapo_rule_accepts_gold_and_rejects_wrong_or_cut_responses(task: str) -> None:
    for record in synthetic_records(task, 100, seed=3):
        gold = gold_response(task, parse_prompt(record.prompt))
        truth = record.ground_truth
        assert verify_dapo(gold, truth).correct
        assert verify_dapo(ANSWER_PREFIX + truth, truth).correct  # the scratchpad is not scored
        wrong = gold[: -len(truth)] + str(int(truth) + 1)
        assert not verify_dapo(wrong, truth).correct
        for cut in range(1, len(gold)):  # cut anywhere before the answer is complete
            assert not verify_dapo(gold[:cut], truth).correct, gold[:cut]
        assert not verify_dapo(gold + ",3", truth).correct  # junk on the answer line
        assert verify_dapo(gold + "\n5,", truth).correct  # after the line: the rule ignores it


@pytest.mark.parametrize("task", TASKS)
def test_split_is_fixed_disjoint_and_complete(task: str) -> None:
    train = [r.prompt for r in synthetic_records(task, split="train")]
    test = [r.prompt for r in synthetic_records(task, split="test")]
    assert len(set(train)) == len(train) and len(set(test)) == len(test)
    assert not set(train) & set(test)
    pool = {",".join(map(str, d)) + "=" for d in prompt_pool(task)}
    assert set(train) | set(test) == pool
    assert len(test) == round(len(pool) * 0.2)
    assert {r.prompt for r in synthetic_records(task, split="test", seed=9)} == set(test)
    ids = [r.prompt_id for r in _all(task)]
    assert len(set(ids)) == len(ids)  # ids never repeat across the splits


def test_corpus_holds_the_reference_responses() -> None:
    corpus = set(iter_synthetic_corpus())
    assert "3,7,7,7\nAnswer: 7" in corpus or any(ANSWER_PREFIX in t for t in corpus)
    for task in TASKS:
        for record in synthetic_records(task, 20, seed=1):
            assert gold_response(task, parse_prompt(record.prompt)) in corpus


def test_on_correct_path() -> None:
    gold, answer = "3,7,7,7\nAnswer: 7", "7"
    assert on_correct_path("3,7,7,9,9,9,9,9,9,9", gold, answer)  # following the reference
    assert on_correct_path("5\nAnswer: 7\nAnswer: 7\nAns", gold, answer)  # answered, kept going
    assert not on_correct_path("3,8,8,8,8,8,8", gold, answer)
    assert not on_correct_path("Answer: 7Answer: 7", gold, answer)  # no complete answer line


def test_profile_counts_truncation_and_correctness() -> None:
    base = {"gold": "3,7\nAnswer: 7", "answer": "7", "gold_tokens": 5}
    rows = [
        {**base, "text": "3,7\nAnswer: 7", "tokens": 5, "truncated": False},
        {**base, "text": "3,7,7,7,7,7", "tokens": 11, "truncated": True},
        {**base, "text": "9999999999", "tokens": 10, "truncated": True},
        {**base, "text": "Answer: 6", "tokens": 3, "truncated": False},
    ]
    result = profile(rows)
    assert (result.truncated, result.truncated_on_path, result.correct) == (0.5, 0.5, 0.25)
    assert result.mean_tokens == pytest.approx(29 / 4)


def test_prompt_round_trip() -> None:
    for digits in itertools.islice(prompt_pool("runmax"), 0, 1500, 97):
        assert parse_prompt(",".join(map(str, digits)) + "=") == digits


@pytest.mark.slow
def test_a_short_dapo_run_on_runmax(tmp_path: Path, tiny_model: Path) -> None:
    """`dapo up --preset tiny_runmax` for two small steps: real Redis and services, the
    `dapo` rule, dynamic sampling, and an L_max that cuts off part of the batch."""
    run_dir = tmp_path / "run"
    sets = ["shared.train_batch_groups=4", "shared.group_size=8", "controller.eval.limit=20"]
    run_ok([*up_argv(run_dir, tiny_model, "tiny_runmax"), "--steps", "2", *set_args(sets)], 300)
    report = json.loads((run_dir / "report.json").read_text())
    assert report["ledger"]["ok"] and report["ledger"]["trained"] == 2 * 4
    steps = report["steps"]
    assert [s["step"] for s in steps] == [1, 2]
    assert all(0 < s["accuracy"] < 1 for s in steps)  # dynamic sampling kept mixed groups
    assert all(s["response_length_max"] <= 20 for s in steps)
    assert any(s["truncated_frac"] > 0 for s in steps)  # a random model runs into L_max
    assert report["eval_before"]["prompts"] == report["eval_after"]["prompts"] == 20
    assert report["eval_before"]["verifier"] == "dapo"
