"""Capabilities are declared, never probed: no `getattr`/`hasattr` in the roles' code
unless its line says why it is not a probe of one of our protocol objects.

A probe (`getattr(engine, "max_concurrent_calls", 1)`) hides from the type checker what
an object must offer: an implementation that forgets it silently gets the default. What
remains are lookups on objects we do not define (transformers configs, DeepSpeed
parameters, gRPC handlers, argparse namespaces) and plumbing by field name (config
sections, dataclass fields), each marked on its line with `# probe-ok: <reason>`.
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("rollout", "learner", "services", "reward")
PROBES = {"getattr", "hasattr"}
MARK = "# probe-ok:"
MIN_REASON = 10  # characters: a reason, not a bare marker


def _comments(source: str) -> dict[int, str]:
    """Each line's comment (tokenize: a `#` inside a string is not one)."""
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return {t.start[0]: t.string for t in tokens if t.type == tokenize.COMMENT}


def _excused(comment: str | None) -> bool:
    return (
        comment is not None
        and comment.startswith(MARK)
        and (len(comment[len(MARK) :].strip()) >= MIN_REASON)
    )


def _span(node: ast.expr) -> range:
    return range(node.lineno, (node.end_lineno or node.lineno) + 1)


def unexcused_probes(source: str) -> list[int]:
    """Lines that use `getattr`/`hasattr` without a `# probe-ok: <reason>` on a line of
    the expression: of the whole call (the formatter may split it), else of the name
    alone (passed as a function)."""
    tree, comments = ast.parse(source), _comments(source)
    calls = {id(n.func): n for n in ast.walk(tree) if isinstance(n, ast.Call)}
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in PROBES:
            lines = _span(calls.get(id(node), node))
            if not any(_excused(comments.get(line)) for line in lines):
                found.add(node.lineno)
    return sorted(found)


def _sources() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def test_the_scanner_finds_probes_and_honours_only_reasoned_marks() -> None:
    source = (
        "a = getattr(engine, 'max_concurrent_calls', 1)\n"
        "b = hasattr(x, 'abandon')  # probe-ok:\n"
        "c = getattr(cfg, name)  # probe-ok: a config section named by its role\n"
        "d = map(getattr, [x], ['y'])\n"
        "e = '# probe-ok: in a string, not a comment' + getattr(x, 'y')\n"
        "f = getattr(\n    x,\n    'y',\n)  # probe-ok: a transformers config (third party)\n"
    )
    assert unexcused_probes(source) == [1, 2, 4, 5]


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_unexplained_getattr_or_hasattr(path: Path) -> None:
    lines = unexcused_probes(path.read_text())
    assert not lines, (
        f"{path.relative_to(ROOT)}: getattr/hasattr on line(s) {lines}: declare the "
        f"capability in its protocol instead, or, for objects we do not define (or plumbing "
        f"by field name), say so on the line: `{MARK} <reason>`"
    )
