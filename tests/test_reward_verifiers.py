"""The verifiers on hand-made quirk cases and on the real AIME-2024 answers in many formats.

These call the verifier functions in-process with math-verify's own timeout off
(timeout_s=0): pytest-timeout also uses SIGALRM in this main thread.
"""

from __future__ import annotations

import pytest

from reward.verifiers import (
    INVALID,
    extract_answer_line,
    normalize_final_answer,
    run_verifier,
    verify_dapo,
    verify_first_integer,
)
from services.common.data import aime_path

AIME = aime_path()


def aime_answers() -> list[str]:
    """The distinct ground truths of the AIME-2024 eval set (skip if the file is absent)."""
    if not AIME.is_file():
        pytest.skip(f"{AIME} not present: the real-case table needs the shared AIME-2024 file")
    import pyarrow.parquet as pq

    rows = pq.read_table(AIME, columns=["reward_model"]).column("reward_model").to_pylist()
    return sorted({row["ground_truth"] for row in rows}, key=int)


# name → (response template, expected verdicts for dapo, math_verify, cascade, first_integer;
# None = not asserted because that verifier's answer there is not the point).
# {a} is the gold answer, {w} a wrong one, {a2} twice the gold.
FORMATS: dict[str, tuple[str, tuple[bool | None, ...]]] = {
    "plain": ("Step 1: think.\nAnswer: {a}", (True, True, True, False)),
    "boxed": ("Answer: \\boxed{{{a}}}", (True, True, True, True)),
    "dollars": ("Answer: ${a}$", (True, True, True, True)),
    "lower_case_spaced": ("so...\nanswer :   {a}", (True, True, True, True)),
    "newline_after_colon": ("Answer:\n{a}", (True, True, True, True)),
    "equation": ("Answer: x = {a}", (True, True, True, True)),
    "units": ("Answer: {a} units", (True, True, True, True)),
    "text": ("Answer: \\text{{{a}}}", (True, None, True, True)),
    "degrees": ("Answer: {a}^\\circ", (True, True, True, True)),
    "dollar_period": ("Answer: ${a}.$", (True, True, True, True)),
    "nested_boxed": ("Answer: \\boxed{{\\boxed{{{a}}}}}", (False, True, True, True)),
    "trailing_period": ("Answer: {a}.", (False, True, True, True)),
    "decimal": ("Answer: {a}.0", (False, True, True, True)),
    "fraction": ("Answer: \\frac{{{a2}}}{{2}}", (False, True, True, False)),
    "boxed_no_answer_line": ("The final answer is $\\boxed{{{a}}}$.", (False, True, True, True)),
    "last_match_wins": ("Answer: {w}\nWait, that is wrong.\nAnswer: {a}", (True, True, True, None)),
    "earlier_match_loses": ("Answer: {a}\nHmm.\nAnswer: {w}", (False, False, False, True)),
    "out_of_window": ("Answer: {a}\n" + "Double-check it all. " * 15, (False, True, True, True)),
    "wrong": ("Answer: {w}", (False, False, False, False)),
    "tiny_model": ("{a}+{a}+", (False, None, None, True)),
    "empty": ("", (False, False, False, False)),
}
VERIFIER_ORDER = ("dapo", "math_verify", "cascade", "first_integer")


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_aime_answers_in_many_formats(fmt: str) -> None:
    template, expected = FORMATS[fmt]
    for gold in aime_answers():
        a = int(gold)
        response = template.format(a=a, w=a + 1, a2=2 * a)
        for verifier, want in zip(VERIFIER_ORDER, expected, strict=True):
            verdict = run_verifier(verifier, response, gold, 0)
            assert verdict.error == "", (fmt, gold, verifier, verdict)
            if want is not None:
                assert verdict.correct is want, (fmt, gold, verifier, verdict)


def test_aime_file_holds_the_real_answers() -> None:
    answers = aime_answers()
    assert len(answers) >= 29 and all(0 <= int(a) <= 999 for a in answers)


def test_cascade_reports_which_verifier_decided() -> None:
    assert run_verifier("cascade", "Answer: 104", "104", 0).verifier == "dapo"
    fallback = run_verifier("cascade", "Answer: 0.5", "\\frac{1}{2}", 0)
    assert (fallback.correct, fallback.verifier, fallback.pred) == (True, "math_verify", "0.5")


@pytest.mark.parametrize(
    ("pred", "gold"),
    [
        ("1/2", "\\frac{1}{2}"),
        ("0.5", "\\frac{1}{2}"),
        ("\\frac12", "0.5"),
        ("\\dfrac{1}{2}", "1/2"),
    ],
)
def test_cascade_accepts_equivalent_forms_the_rule_rejects(pred: str, gold: str) -> None:
    response = f"Therefore\nAnswer: {pred}"
    assert not verify_dapo(response, gold).correct
    assert run_verifier("cascade", response, gold, 0).correct


def test_math_verify_is_called_gold_first() -> None:
    # Asymmetric in math-verify: gold "x=3" with prediction "3" counts.
    assert run_verifier("math_verify", "The answer is $3$", "x=3", 0).correct


# -- the dapo rule's quirks, one by one (module docstring of reward.verifiers) ----------


def test_rule_reads_only_the_last_300_characters() -> None:
    head = "Answer: 42\n"  # 11 characters
    assert verify_dapo(head + "x" * 289, "42").correct  # exactly 300
    assert not verify_dapo(head + "x" * 290, "42").correct  # "A" falls out of the window
    assert not verify_dapo(head + "x" * 293, "42").correct  # ": 42" no longer follows


def test_rule_takes_the_last_match_case_insensitively() -> None:
    assert extract_answer_line("ANSWER: 1\nthe answer: 2\nfinal answer :3") == "3"
    assert extract_answer_line("no marker here") is None
    assert verify_dapo("nothing", "5").pred == INVALID


@pytest.mark.parametrize(
    ("raw", "normalized"),
    [
        ("x = 5", "5"),
        ("a=b=7", "7"),
        ("1,000", "1000"),
        ("1,000.5", "1,000.5"),
        ("$42.$", "42"),
        ("42.", "42."),
        ("\\boxed{18}", "18"),
        ("\\boxed{\\boxed{18}}", "\\boxed{18}"),
        ("\\text{ 5 cm}", "5"),
        ("\\textbf{12}", "12"),
        ("\\frac12", "\\frac{1}{2}"),
        ("\\sqrt2", "\\sqrt{2}"),
        ("$\\frac{1}{2}$ or $3$", "\\frac{1}{2}"),
        ("90^\\circ", "90"),
        ("5 dollars", "5"),
        ("banana split", "banansplit"),  # "a " deleted inside a word
        ("always", "al"),
        ("\\$ 25", "25"),
        ("  7  ", "7"),
    ],
)
def test_minerva_normalisation(raw: str, normalized: str) -> None:
    assert normalize_final_answer(raw) == normalized


def test_rule_applies_normalisation_to_the_ground_truth_too() -> None:
    assert verify_dapo("Answer: 5", "x = 5").correct
    assert verify_dapo("Answer: \\frac12", "\\frac{1}{2}").correct


def test_first_integer() -> None:
    assert verify_first_integer("9+9+", "9").correct
    assert verify_first_integer("-3 then 4", "-3").correct
    assert verify_first_integer("007", "7").correct
    assert not verify_first_integer("no digits", "0").correct
    assert verify_first_integer("1" * 5000, "1" * 5000).correct  # past int() digit limit


@pytest.mark.parametrize("verifier", VERIFIER_ORDER)
@pytest.mark.parametrize(
    "response",
    ["", "\ud800 lone surrogate Answer: 5\udfff", "Answer: \\boxed{\\boxed{\\boxed{", "}" * 500],
)
def test_odd_inputs_never_raise(verifier: str, response: str) -> None:
    verdict = run_verifier(verifier, response, "5", 0)
    assert verdict.correct in (True, False)


def test_unknown_verifier_is_an_error_verdict() -> None:
    verdict = run_verifier("nope", "Answer: 5", "5", 0)
    assert (verdict.correct, verdict.error) == (False, "unknown verifier 'nope'")
