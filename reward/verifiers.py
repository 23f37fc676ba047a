"""The answer checks: the paper's `dapo` rule, math-verify, their cascade, first integer.

Each is a pure function of (response, ground truth) returning a `Verdict` and never
raises on bad input; they run in `reward.pool`'s worker processes but are plain
functions, so tests and the in-process benchmark call them directly. The `dapo` rule
keeps the reference "math_dapo" rule's quirks on purpose (rewards that differ change
which groups are informative). What each verifier reads: docs/reward.md, "Verifiers".
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import lru_cache

INVALID = "[INVALID]"
RULE_WINDOW_CHARS = 300
ANSWER_PATTERN = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")

# Replaced in this order, each everywhere in the string (Minerva / lm-eval normalisation).
_SUBSTITUTIONS: tuple[tuple[str, str], ...] = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
# Deleted in this order, as substrings. The reference list has no "ft" (Minerva's has).
_UNIT_WORDS = (
    "square ways integers dollars mph inches hours km units \\ldots sue points feet minutes "
    "digits cents degrees cm gm pounds meters meals edges students childrentickets multiples"
).split()
_TEX_NOISE = (
    "\\text{s}",
    "\\text{.}",
    "\\text{\ns}",
    "\\text{}^2",
    "\\text{}^3",
    "\\text{\n}",
    "\\text{}",
    "\\mathrm{th}",
    "^\\circ",
    "^{\\circ}",
    "\\;",
    ",\\!",
    "{,}",
    '"',
    "\\dots",
)
_REMOVED = (*_UNIT_WORDS, *_TEX_NOISE)
# Regex rewrites, in order: first $...$ span; unwrap \text, \textbf, \overline (lazy) and
# \boxed (greedy); shorthand \fracab and \sqrta.
_REWRITES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"(.*?)(\$)(.*?)(\$)(.*)"), r"$\3$"),
    (re.compile(r"(\\text\{)(.*?)(\})"), r"\2"),
    (re.compile(r"(\\textbf\{)(.*?)(\})"), r"\2"),
    (re.compile(r"(\\overline\{)(.*?)(\})"), r"\2"),
    (re.compile(r"(\\boxed\{)(.*)(\})"), r"\2"),
    (re.compile(r"(frac)([^{])(.)"), r"frac{\2}{\3}"),
    (re.compile(r"(sqrt)([^{])"), r"sqrt{\2}"),
)
_FIRST_INTEGER = re.compile(r"-?[0-9]+")
_MAX_INT_DIGITS = 4000  # below CPython's int-from-str limit (4300)
MAX_PRED_CHARS = 1000


@dataclass(frozen=True)
class Verdict:
    """One verification outcome. `error` is set when the check failed or timed out."""

    correct: bool
    pred: str
    verifier: str
    error: str = ""


def normalize_final_answer(text: str) -> str:
    """Minerva / lm-eval answer normalisation, exactly as the reference rule does it."""
    text = text.split("=")[-1]
    for before, after in _SUBSTITUTIONS:
        text = text.replace(before, after)
    for expr in _REMOVED:
        text = text.replace(expr, "")
    for pattern, repl in _REWRITES:
        text = pattern.sub(repl, text)
    text = text.replace("$", "")
    if text.replace(",", "").isdigit():
        text = text.replace(",", "")
    return text.strip()


def extract_answer_line(response: str) -> str | None:
    """The raw text of the last `Answer:` match in the rule's 300-character window."""
    matches = ANSWER_PATTERN.findall(response[-RULE_WINDOW_CHARS:])
    return matches[-1] if matches else None


@lru_cache(maxsize=4096)
def _normalized_gold(ground_truth: str) -> str:
    """Ground truths repeat G times per group, so normalise each once per worker."""
    return normalize_final_answer(ground_truth)


def verify_dapo(response: str, ground_truth: str) -> Verdict:
    """The paper's rule: last-300-chars `Answer:` match, normalised, exact match."""
    raw = extract_answer_line(response)
    pred = normalize_final_answer(INVALID if raw is None else raw)
    return Verdict(pred == _normalized_gold(ground_truth), pred, "dapo")


def verify_first_integer(response: str, ground_truth: str) -> Verdict:
    """The first integer in the response against the integer ground truth."""
    match = _FIRST_INTEGER.search(response)
    if match is None:
        return Verdict(False, "", "first_integer")
    pred, gold = match.group(), ground_truth.strip()
    return Verdict(_same_integer(pred, gold), pred, "first_integer")


def _same_integer(pred: str, gold: str) -> bool:
    """Integer equality ("007" is 7); string equality when either side is not one."""
    small = len(pred) < _MAX_INT_DIGITS and len(gold) < _MAX_INT_DIGITS
    if small and _FIRST_INTEGER.fullmatch(gold):
        return int(pred) == int(gold)
    return pred == gold


def _gold_for_math_verify(ground_truth: str) -> str:
    """Wrap a bare ground truth so math-verify's LaTeX extraction sees all of it."""
    if "$" in ground_truth or "\\boxed" in ground_truth:
        return ground_truth
    return f"${ground_truth}$"


def verify_math_verify(response: str, ground_truth: str, timeout_s: int = 0) -> Verdict:
    """math-verify: parse both, verify(gold, pred). `timeout_s` is its own SIGALRM limit
    (0 = none; then only killing the worker bounds it). Errors become `Verdict.error`."""
    from math_verify import parse, verify  # imported lazily: workers preload it

    limit = timeout_s or None
    try:
        gold_text = _gold_for_math_verify(ground_truth)
        gold = parse(gold_text, parsing_timeout=limit, raise_on_error=True)
        pred = parse(response, parsing_timeout=limit, raise_on_error=True)
        correct = bool(verify(gold, pred, timeout_seconds=limit, raise_on_error=True))
    except BaseException as exc:  # noqa: B036 - math-verify's TimeoutException is a BaseException
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        return Verdict(False, "", "math_verify", _describe(exc))
    return Verdict(correct, _pred_text(pred), "math_verify")


def _pred_text(parsed: list[object]) -> str:
    """math-verify returns [sympy object, extracted string]; report the string."""
    strings = [p for p in parsed if isinstance(p, str)]
    return strings[-1] if strings else (str(parsed[0]) if parsed else "")


def _describe(exc: BaseException) -> str:
    """A one-line error naming the failure, short enough for a metric log."""
    kind = "timeout" if "Timeout" in type(exc).__name__ else "error"
    return f"math_verify {kind}: {type(exc).__name__}: {str(exc)[:200]}"


def verify_cascade(response: str, ground_truth: str, timeout_s: int = 0) -> Verdict:
    """The rule first; math-verify only when the rule says wrong."""
    rule = verify_dapo(response, ground_truth)
    if rule.correct:
        return rule
    line = extract_answer_line(response)
    if line is None:
        return verify_math_verify(response, ground_truth, timeout_s)
    verdict = verify_math_verify(line, ground_truth, timeout_s)
    if verdict.correct or verdict.error or "$" in line:
        return verdict
    # Bare LaTeX such as `\frac12` or `\text{5}` is only read inside math delimiters.
    wrapped = verify_math_verify(f"${line}$", ground_truth, timeout_s)
    return wrapped if wrapped.correct or wrapped.error else verdict


Check = Callable[[str, str, int], Verdict]
VERIFIERS: dict[str, Check] = {
    "dapo": lambda r, g, _t: verify_dapo(r, g),
    "math_verify": verify_math_verify,
    "cascade": verify_cascade,
    "first_integer": lambda r, g, _t: verify_first_integer(r, g),
}


def run_verifier(name: str, response: str, ground_truth: str, timeout_s: int = 0) -> Verdict:
    """Run the named verifier; any failure becomes a wrong verdict with an error.

    The reported `pred` is cut to MAX_PRED_CHARS: a million-digit "integer" must not be
    echoed back once per item."""
    check = VERIFIERS.get(name)
    if check is None:
        return Verdict(False, "", name, f"unknown verifier {name!r}")
    try:
        verdict = check(response, ground_truth, timeout_s)
    except Exception as exc:  # a bug in a rule must not take the batch down
        return Verdict(False, "", name, f"{name} error: {type(exc).__name__}: {str(exc)[:200]}")
    if len(verdict.pred) > MAX_PRED_CHARS:
        verdict = replace(verdict, pred=verdict.pred[: MAX_PRED_CHARS - 3] + "...")
    return verdict
