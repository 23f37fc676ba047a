"""`dapo` as users run it: a child process of `python -m services.tools.cli`
(`services.tools.cli.DAPO_ARGV`; a `dapo up` command line starts with `up_argv`)."""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from services.tools.cli import DAPO_ARGV

DAPO = list(DAPO_ARGV)


# What a shell gives a job it starts; a suite started with `nohup` or `&` hands its
# children SIGINT/SIGHUP ignored, and `dapo up` keeps an ignored signal ignored (so that
# `nohup dapo up` survives a closed terminal), which made a test's Ctrl-C do nothing.
TERMINAL_SIGNALS = (signal.SIGINT, signal.SIGHUP, signal.SIGTERM)


def _terminal_signals() -> None:
    for s in TERMINAL_SIGNALS:
        signal.signal(s, signal.SIG_DFL)


def popen_as_typed(argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
    """Start `argv` as a user's shell would, whatever the suite inherited: the signals
    a test sends it (Ctrl-C, a closed terminal, a kill) at their default dispositions."""
    return subprocess.Popen(argv, preexec_fn=_terminal_signals, **kwargs)


def set_args(sets: Iterable[str]) -> list[str]:
    """`--set KEY=VALUE` for each override."""
    return [arg for pair in sets for arg in ("--set", pair)]


def run(argv: Sequence[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run `argv` to its end, stdout and stderr captured as text."""
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


def dapo(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run `dapo ARGS` to its end, stdout and stderr captured as text."""
    return run([*DAPO, *args], timeout)


def run_ok(argv: Sequence[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """`run(argv)`, failing the test with the end of its stderr unless it exits 0."""
    result = run(argv, timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def run_eval(model: Path, data: str | Path, out: Path, *options: str, timeout: float = 120) -> Any:
    """`dapo eval` of `model` on `data` (first-integer verifier, no chat template) with
    `options`; the report it wrote to `out`."""
    args = ["--model", str(model), "--data", str(data), *options, "--out", str(out)]
    verify = ["--verifier", "first_integer", "--no-chat-template"]
    run_ok([*DAPO, "eval", *args, *verify], timeout=timeout)
    return json.loads(out.read_text())
