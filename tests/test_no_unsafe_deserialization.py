"""No pickle, eval/exec, torch.load or unsafe yaml.load anywhere in the shipped source.

Scans code tokens (not comments or strings, so "never pickle" in a docstring is fine) of
every non-test Python file. An allowed hit needs an entry in ALLOWED with the reason; an
entry that no longer matches fails too, so the list cannot rot.
"""

from __future__ import annotations

import io
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("services", "rollout", "reward", "learner", "benchmarks", "scripts", "proto")
UNPICKLERS = {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "allow_pickle"}
YAML_UNSAFE = {"unsafe_load", "full_load", "unsafe_load_all", "full_load_all", "load_all"}
SAFE_LOADERS = {"SafeLoader", "CSafeLoader"}

# (file, rule) -> why it is acceptable. Keep this short.
ALLOWED: dict[tuple[str, str], str] = {
    ("learner/deepspeed_policy.py", "checkpoint-load"): (
        "DeepSpeed's engine.load_checkpoint unpickles (torch.load) the checkpoint files that "
        "this learner wrote itself under learner.checkpoint.dir; that directory must be "
        "trusted storage (docs/security.md). There is no weights-only mode for its optimizer "
        "and engine state."
    ),
    ("services/tools/eval_source.py", "torch.load"): (
        "`dapo eval --run` reads a DeepSpeed checkpoint's model states with "
        "weights_only=True: tensors and plain containers, no code is unpickled."
    ),
}


def code_tokens(source: str) -> list[tokenize.TokenInfo]:
    """NAME and OP tokens only: comments and string literals cannot trigger a rule."""
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return [t for t in tokens if t.type in (tokenize.NAME, tokenize.OP)]


def rule_at(tokens: list[tokenize.TokenInfo], i: int) -> str | None:
    """The rule the token at i breaks, if any."""
    prev = tokens[i - 1].string if i else ""
    word = tokens[i].string
    nxt = [t.string for t in tokens[i + 1 : i + 4]]
    if word in UNPICKLERS:
        return "pickle"
    if word in ("eval", "exec") and nxt[:1] == ["("] and prev not in (".", "def"):
        return word
    if word == "torch" and nxt == [".", "load", "("]:
        return "torch.load"
    if word == "load_checkpoint" and i > 1 and tokens[i - 2].string == "engine" and prev == ".":
        return "checkpoint-load"  # a DeepSpeed engine torch.loads what it reads
    if word == "yaml" and nxt[:2] == [".", "load"] and nxt[2:3] == ["("]:
        return "yaml.load" if not safe_loader(tokens, i) else None
    if word == "yaml" and nxt[:1] == ["."] and nxt[1:2] and nxt[1] in YAML_UNSAFE:
        return f"yaml.{nxt[1]}"
    return None


def safe_loader(tokens: list[tokenize.TokenInfo], i: int) -> bool:
    """yaml.load(..., Loader=SafeLoader) on the same logical line counts as safe."""
    line = tokens[i].start[0]
    rest = [t.string for t in tokens[i:] if t.start[0] <= line + 3]
    return any(name in SAFE_LOADERS for name in rest)


def violations(path: Path) -> list[tuple[str, str, int]]:
    rel = str(path.relative_to(ROOT))
    tokens = code_tokens(path.read_text())
    found = []
    for i, token in enumerate(tokens):
        rule = rule_at(tokens, i)
        if rule is not None:
            found.append((rel, rule, token.start[0]))
    return found


def scanned_files() -> list[Path]:
    return sorted(p for top in SCANNED for p in (ROOT / top).rglob("*.py"))


def snippet_hits(source: str) -> list[str]:
    tokens = code_tokens(source)
    return [r for i in range(len(tokens)) if (r := rule_at(tokens, i)) is not None]


def test_rules_catch_what_they_should() -> None:
    assert snippet_hits("import pickle\n") == ["pickle"]
    assert snippet_hits("x = eval('1')\nexec(code)\n") == ["eval", "exec"]
    assert snippet_hits("state = torch.load(f)\n") == ["torch.load"]
    assert snippet_hits("d = yaml.load(text)\n") == ["yaml.load"]
    assert snippet_hits("d = yaml.unsafe_load(text)\n") == ["yaml.unsafe_load"]
    assert snippet_hits("a = np.load(f, allow_pickle=True)\n") == ["pickle"]
    for fine in (
        "d = yaml.load(text, Loader=yaml.SafeLoader)\n",
        "d = yaml.safe_load(text)\n",
        "model.eval()\n",
        "def run_eval(args):\n    pass\n",
        '"""never pickle"""  # no eval( here\n',
    ):
        assert snippet_hits(fine) == [], fine


def test_no_unsafe_deserialization_in_the_source() -> None:
    files = scanned_files()
    assert len(files) > 50  # the scan sees the tree
    hits = [v for p in files for v in violations(p)]
    unexplained = [f"{f}:{line}: {rule}" for f, rule, line in hits if (f, rule) not in ALLOWED]
    assert unexplained == [], "unsafe deserialization (or add to ALLOWED with a reason)"
    used = {(f, rule) for f, rule, _ in hits}
    assert set(ALLOWED) <= used, f"stale ALLOWED entries: {set(ALLOWED) - used}"
