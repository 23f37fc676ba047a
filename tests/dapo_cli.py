"""`dapo` as users run it: a child process of `python -m services.tools.cli`."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

DAPO = [sys.executable, "-m", "services.tools.cli"]


def set_args(sets: Iterable[str]) -> list[str]:
    """`--set KEY=VALUE` for each override."""
    return [arg for pair in sets for arg in ("--set", pair)]


def up_args(preset: str, run_dir: Path, *options: str, sets: Iterable[str] = ()) -> list[str]:
    """The arguments of `dapo up --preset PRESET --run-dir RUN_DIR OPTIONS --set ...`."""
    return ["up", "--preset", preset, "--run-dir", str(run_dir), *options, *set_args(sets)]


def dapo(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run `dapo ARGS` to its end, stdout and stderr captured as text."""
    return subprocess.run([*DAPO, *args], capture_output=True, text=True, timeout=timeout)


def dapo_ok(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """`dapo(ARGS)`, failing the test with the end of stderr unless it exits 0."""
    result = dapo(*args, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def run_eval(model: Path, data: str | Path, out: Path, *options: str, timeout: float = 120) -> Any:
    """`dapo eval` of `model` on `data` (first-integer verifier, no chat template) with
    `options`; the report it wrote to `out`."""
    args = ["--model", str(model), "--data", str(data), *options, "--out", str(out)]
    dapo_ok("eval", *args, "--verifier", "first_integer", "--no-chat-template", timeout=timeout)
    return json.loads(out.read_text())
