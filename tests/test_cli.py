"""The `dapo` command line: instant help, one-line errors with a non-zero exit."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.net import free_port
from services.common.redis_server import RedisServer

SUBCOMMANDS = [
    "up", "controller", "rollout", "reward", "buffer", "learner",
    "eval", "ledger", "bench", "config", "init-model",
]  # fmt: skip


def dapo(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.tools.cli", *args],
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def assert_one_line_error(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in lines[0]


def test_help_lists_every_subcommand() -> None:
    result = dapo("--help")
    assert result.returncode == 0
    for name in SUBCOMMANDS:
        assert name in result.stdout


def test_help_imports_nothing_heavy() -> None:
    code = (
        "import sys, contextlib, io\n"
        "from services.tools.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "    main(['--help'])\n"
        "print(sorted(m for m in ('torch','transformers','grpc','fastapi','redis','deepspeed',"
        "'math_verify') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("role", ["controller", "rollout", "reward", "buffer", "learner"])
def test_every_service_takes_the_common_flags(role: str) -> None:
    help_text = dapo(role, "--help").stdout
    for flag in ("--config", "--redis-url", "--grpc-port", "--http-port", "--set"):
        assert flag in help_text


def test_config_show_prints_the_resolved_config() -> None:
    result = dapo(
        "config", "show", "--preset", "tiny", "--set", "learner.lr=0.5", "--format", "json"
    )
    data = json.loads(result.stdout)
    assert data["learner"]["lr"] == 0.5 and data["shared"]["run_name"] == "tiny"


def test_unknown_preset(tmp_path: Path) -> None:
    assert_one_line_error(dapo("up", "--preset", "huge"), "unknown preset 'huge'")


def test_malformed_config(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("learner:\n  lr: -3\n")
    assert_one_line_error(dapo("config", "show", "--config", str(bad)), "learner.lr")


def test_missing_model_dir(tmp_path: Path) -> None:
    result = dapo("up", "--set", f"shared.model_path={tmp_path / 'nope'}")
    assert_one_line_error(result, "model directory not found")


def test_unreachable_redis() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    assert_one_line_error(dapo("buffer", "--redis-url", url), "cannot reach Redis", url)


def test_service_without_redis_says_so() -> None:
    assert_one_line_error(dapo("buffer"), "--redis-url")


def test_occupied_port(redis_server: RedisServer) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        result = dapo("buffer", "--redis-url", redis_server.url, "--http-port", str(port))
    assert_one_line_error(result, f"127.0.0.1:{port}")


def test_unknown_benchmark() -> None:
    result = dapo("bench", "nope")
    assert_one_line_error(result, "no benchmark 'nope'")
    assert "learner_step" in result.stderr and "weights" in result.stderr  # found benchmarks/
