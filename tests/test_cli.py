"""The `dapo` command line: instant help, one-line errors with a non-zero exit."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from dapo_cli import dapo as run_dapo

from services.common.net import free_port
from services.common.redis_server import RedisServer

SUBCOMMANDS = [
    "up",
    "controller",
    "rollout",
    "reward",
    "buffer",
    "learner",
    "eval",
    "ledger",
    "bench",
    "config",
    "init-model",
]


def dapo(*args: str) -> subprocess.CompletedProcess[str]:
    """`dapo ARGS` with time for the slowest here (`dapo up`)."""
    return run_dapo(*args, timeout=300)


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
        "config",
        "show",
        "--preset",
        "tiny",
        "--set",
        "learner.optimizer.lr=0.5",
        "--format",
        "json",
    )
    data = json.loads(result.stdout)
    assert data["learner"]["optimizer"]["lr"] == 0.5 and data["shared"]["run_name"] == "tiny"


@pytest.mark.parametrize(
    ("staleness", "hard", "partial", "correction"),
    [(0, 0, False, "none"), (2, 8, True, "token_tis")],
)
def test_config_show_prints_auto_values_resolved(
    staleness: int, hard: int, partial: bool, correction: str, tmp_path: Path
) -> None:
    """ "None = auto" fields show what the run will use, and the shown file reads back as is."""
    args = ("config", "show", "--set", f"shared.max_staleness={staleness}", "--format", "json")
    data = json.loads(dapo(*args).stdout)
    assert data["shared"]["max_staleness_hard"] == hard
    assert data["rollout"]["partial_rollouts"] is partial
    assert data["learner"]["objective"]["correction"]["kind"] == correction
    shown = tmp_path / "shown.json"
    shown.write_text(json.dumps(data))
    again = dapo("config", "show", "--config", str(shown), "--format", "json")
    assert json.loads(again.stdout) == data


def test_config_show_keeps_explicit_values_of_auto_fields() -> None:
    sets = [
        "shared.max_staleness=2",
        "shared.max_staleness_hard=3",
        "rollout.partial_rollouts=false",
    ]
    flags = [arg for value in sets for arg in ("--set", value)]
    data = json.loads(dapo("config", "show", *flags, "--format", "json").stdout)
    assert data["shared"]["max_staleness_hard"] == 3
    assert data["rollout"]["partial_rollouts"] is False


def test_unknown_preset(tmp_path: Path) -> None:
    assert_one_line_error(dapo("up", "--preset", "huge"), "unknown preset 'huge'")


def test_malformed_config(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("learner:\n  optimizer:\n    lr: -3\n")
    assert_one_line_error(dapo("config", "show", "--config", str(bad)), "learner.optimizer.lr")


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


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["up", "--grpc-port", "1"], "dapo up: error: unrecognized arguments: --grpc-port 1"),
        (["up", "--steps", "x"], "argument --steps: invalid int value: 'x'"),
        (["config", "show", "--bogus"], "dapo config: error: unrecognized arguments: --bogus"),
        (["buffer", "--bogus"], "dapo buffer: error: unrecognized arguments: --bogus"),
        (["eval", "--model", "m", "--data", "d", "--verifier", "bogus"], "invalid choice: 'bogus'"),
        (["eval", "--data", "synthetic:max3"], "--model is required"),
        (["eval", "--run", "/nonexistent/run"], "not a run directory"),
        (["ledger", "--run", "/nonexistent/run"], "not a run directory"),
        (["init-model", "--out", "/nonexistent/m", "--preset", "bogus"], "preset 'bogus'"),
        (["ablate", "--preset", "tiny"], "'tiny' is now 'tiny_runmax'"),
        (["ablate", "--preset", "huge"], "unknown ablation preset 'huge'"),
        (["nope"], "dapo: error: argument COMMAND: invalid choice: 'nope'"),
    ],
)
def test_bad_input_to_every_subcommand_is_one_line(args: list[str], needle: str) -> None:
    assert_one_line_error(dapo(*args), needle)


def test_up_has_no_port_flags_it_would_ignore() -> None:
    help_text = dapo("up", "--help").stdout
    assert "--grpc-port" not in help_text and "--http-port" not in help_text
    assert "--redis-url" in help_text


def test_bench_without_a_name_lists_the_benchmarks() -> None:
    result = dapo("bench")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "required" not in result.stderr
    assert "dapo bench [--repeats N] [--load-below L] NAME" in result.stdout
    assert "  learner_step" in result.stdout


def test_init_model_refuses_to_overwrite_without_force(tmp_path: Path) -> None:
    out = tmp_path / "model"
    assert dapo("init-model", "--out", str(out)).returncode == 0
    config = (out / "config.json").read_text()
    (out / "config.json").write_text("mine")
    assert_one_line_error(dapo("init-model", "--out", str(out)), "not empty", "--force")
    assert (out / "config.json").read_text() == "mine"  # nothing was touched
    assert dapo("init-model", "--out", str(out), "--force").returncode == 0
    assert (out / "config.json").read_text() == config


def test_eval_help_shows_every_default() -> None:
    help_text = " ".join(dapo("eval", "--help").stdout.split())
    for default in ("(K) [32]", "limit [1024]", "[1.0]", "[0.7]", "[cascade]", "seed [0]"):
        assert default in help_text, default
    assert "--run DIR" in help_text


def test_eval_refuses_a_response_longer_than_the_model(tiny_model: Path) -> None:
    result = dapo("eval", "--model", str(tiny_model), "--data", "synthetic:max3")
    assert_one_line_error(result, "--max-tokens 1024", "256 positions")


def test_eval_bad_sampling_and_a_broken_model_are_one_line(
    tiny_model: Path, tmp_path: Path
) -> None:
    base = ["eval", "--data", "synthetic:max3", "--max-tokens", "4", "--limit", "2"]
    assert_one_line_error(dapo(*base, "--model", str(tiny_model), "--n", "0"), "n must be >= 1")
    assert_one_line_error(dapo(*base, "--model", str(tiny_model), "--limit", "0"), "--limit")
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tiny_model / name).read_bytes())
    (tmp_path / "config.json").write_text("{}")  # weights and a tokenizer, a broken config
    assert_one_line_error(dapo(*base, "--model", str(tmp_path)), "DAPO_DEBUG=1")
    (tmp_path / "tokenizer.json").unlink()  # refused before loading: one line, exit 2
    result = dapo(*base, "--model", str(tiny_model.parent / "absent"))
    assert result.returncode == 2
    assert_one_line_error(dapo(*base, "--model", str(tmp_path)), "no tokenizer")


def test_config_show_reads_an_old_flat_learner_section(tmp_path: Path) -> None:
    """An old file's flat learner keys load where the nested ones do, each old name warned
    once (naming its new place); one given both ways is a one-line error."""
    old, new = tmp_path / "old.yaml", tmp_path / "new.yaml"
    old.write_text("learner:\n  lr: 2.0e-5\n  checkpoint_dir: /ck\n  weight_transport: grpc\n")
    new.write_text(
        "learner:\n  optimizer: {lr: 2.0e-5}\n  checkpoint: {dir: /ck}\n"
        "  publication: {transport: grpc}\n"
    )
    shown_old = dapo("config", "show", "--preset", "tiny", "--config", str(old), "--format", "json")
    shown_new = dapo("config", "show", "--preset", "tiny", "--config", str(new), "--format", "json")
    assert shown_old.returncode == 0 and json.loads(shown_old.stdout) == json.loads(
        shown_new.stdout
    )
    for moved in (
        "learner.lr is now learner.optimizer.lr",
        "learner.checkpoint_dir is now learner.checkpoint.dir",
        "learner.weight_transport is now learner.publication.transport",
    ):
        assert shown_old.stderr.count(moved) == 1, shown_old.stderr
    assert "is now" not in shown_new.stderr
    both = dapo("config", "show", "--config", str(old), "--set", "learner.optimizer.lr=1")
    assert both.returncode == 0  # different layers: the later one wins
    twice = ("--set", "learner.lr=1", "--set", "learner.optimizer.lr=2")
    assert_one_line_error(
        dapo("config", "show", "--preset", "tiny", *twice),
        "learner.lr and learner.optimizer.lr both given",
    )
