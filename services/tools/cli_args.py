"""The `dapo` command line's path types and preflight checks (the number and URL types
are in services/common/arg_types.py): a bad path is one line and exit 2 at parse time,
and what only the resolved config can tell (the run directory, the model's files, each
role's interpreter) is checked by `preflight_up` / `preflight_eval` before a process, a
model or a Redis is started. `user_error` is what `dapo` prints for a user's mistake.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from services.common.arg_types import MAX_COUNT
from services.common.errors import DapoError, describe_validation, one_line

if TYPE_CHECKING:
    from services.tools.config import DapoConfig

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
VLLM_VENV = ".venv-vllm"
# learner/init_model.py's PRESETS, named here so that `--help` imports no torch (a test
# keeps the two equal).
MODEL_PRESETS = ("tiny", "tiny_long", "small", "tiny_vllm")


def output_dir(text: str) -> str:
    """An argparse type: a directory that exists or can be created, and written to."""
    problem = checked(dir_problem, Path(text))
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text


def output_file(text: str) -> str:
    """An argparse type: a file that can be written (its directory exists)."""
    problem = checked(file_problem, Path(text))
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text


def existing_dir(text: str) -> str:
    """An argparse type: a directory that exists."""
    if not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{one_line(text)} is not a directory")
    return text


def checked(check: Callable[[Path], str | None], path: Path) -> str | None:
    """`check(path)`, or why the path could not even be looked at (a parent we may not
    search, a name with a NUL byte)."""
    if "\0" in str(path):  # Path.exists() says False; open() and mkdir() raise
        return f"cannot use {one_line(str(path))}: a path holds no NUL byte"
    try:
        return check(path)
    except (OSError, ValueError) as exc:
        return f"cannot use {one_line(str(path))}: {one_line(str(exc))}"


def dir_problem(path: Path) -> str | None:
    """Why `path` cannot be used as an output directory (None: it can)."""
    if path.exists() and not path.is_dir():
        return f"{one_line(str(path))} exists and is not a directory"
    ancestor = path
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"cannot create {one_line(str(path))}: {one_line(str(ancestor))} is not a directory"
    if not can_create_in(ancestor):
        return f"cannot write to {one_line(str(path))}: {one_line(str(ancestor))} is not writable"
    return None


def file_problem(path: Path) -> str | None:
    """Why `path` cannot be written as an output file (None: it can)."""
    if path.is_dir():
        return f"{one_line(str(path))} is a directory, not a file"
    if path.exists():
        return None if os.access(path, os.W_OK) else f"{one_line(str(path))} is not writable"
    parent = path.parent
    if not parent.is_dir():
        return f"cannot write {one_line(str(path))}: no directory {one_line(str(parent))}"
    if not can_create_in(parent):
        return f"cannot write {one_line(str(path))}: {one_line(str(parent))} is not writable"
    return None


def can_create_in(directory: Path) -> bool:
    """Whether a file can really be created in `directory` (os.access says yes to root
    even where the kernel refuses, as in /proc)."""
    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".dapo-probe-"):
            return True
    except OSError:
        return False


def model_dir_problem(path: Path) -> str | None:
    """Why `path` is not a model directory the engines and the tokenizer can load."""
    if not path.is_dir():
        return f"model directory not found: {one_line(str(path))}"
    names = {p.name for p in path.iterdir()}
    if "config.json" not in names:
        return f"{one_line(str(path))} is not a model directory: no config.json"
    if not names & set(WEIGHT_FILES) and not any(n.endswith(".safetensors") for n in names):
        return f"model directory {one_line(str(path))} has no weights (model.safetensors)"
    if not names & set(TOKENIZER_FILES):
        return (
            f"model directory {one_line(str(path))} has no tokenizer ({', '.join(TOKENIZER_FILES)}"
            "): copy the model's tokenizer files beside its weights"
        )
    return None


def interpreter_problem(role: str, python: str) -> str | None:
    """Why the interpreter a role's config names cannot start it."""
    if shutil.which(python) is not None:
        return None
    hint = f"; build it with `make {VLLM_VENV}/.installed`" if VLLM_VENV in python else ""
    return f"{role}.server.python: {python} is not an interpreter here{hint}"


def interpreters(config: DapoConfig, roles: Iterable[str]) -> list[tuple[str, str]]:
    """(role, interpreter) for every role whose config names its own interpreter."""
    sections = [(role, getattr(config, role)) for role in roles]  # probe-ok: a role's section
    named = [(role, section.server.python) for role, section in sections]
    return [(role, python) for role, python in named if python is not None]


def preflight_up(config: DapoConfig, run_dir: str | None) -> None:
    """What `dapo up` would find only after Redis, reward and the learner started: a run
    directory it cannot write, a role interpreter that is missing, a model without a
    tokenizer. One DapoError before anything starts."""
    from services.tools.launcher import ROLES

    out = Path(run_dir or Path("runs") / config.shared.run_name)
    problems = [checked(dir_problem, out)]
    problems += [interpreter_problem(r, p) for r, p in interpreters(config, ROLES)]
    model = config.model_path
    if model is not None and config.shared.model_init is None:
        problems.append(checked(model_dir_problem, Path(model)))
    first = next((p for p in problems if p), None)
    if first:
        raise DapoError(first)


def preflight_eval(args: argparse.Namespace) -> None:
    """`dapo eval`'s model and output file, checked before any data or model is loaded."""
    from services.tools.eval_args import resolve_eval_args

    resolved = resolve_eval_args(args)
    out = None if resolved.out is None else checked(file_problem, Path(resolved.out))
    problems = [
        checked(model_dir_problem, Path(resolved.model)),
        out and f"--out: {out}",
        range_problem("--n", resolved.n, 1, MAX_COUNT),
        range_problem("--seed", resolved.seed, 0, 2**32 - 1),
    ]
    first = next((p for p in problems if p), None)
    if first:
        raise DapoError(first)


def range_problem(flag: str, value: int, low: int, high: int) -> str | None:
    """Why `value` is outside [low, high] (None: it is inside)."""
    if value < low:
        return f"{flag} must be >= {low}, got {value}"
    return f"{flag} must be <= {high}, got {value}" if value > high else None


def user_error(exc: BaseException) -> str | None:
    """The one-line message of an error caused by the user's input (a DapoError, a value
    pydantic refused), or None for a bug."""
    if isinstance(exc, DapoError):
        return str(exc)
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):
        return f"invalid value: {describe_validation(exc.errors(), exc.title)}"
    return None
