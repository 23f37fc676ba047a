"""The `dapo` argument types and preflight checks, in process: each refuses the mistakes
the command line used to accept (a hang, raw pydantic text, a raw OSError, a check found
only after Redis and the services started) with one line that says what to do."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from services.common import arg_types
from services.common.errors import DapoError
from services.common.presets import PRESETS
from services.tools import cli_args
from services.tools.ablation_table import rerender
from services.tools.cli import main
from services.tools.config import load_config

UNWRITABLE = "/proc/dapo-no/such"  # /proc refuses a new file even to root


def refused(parse: Callable[[str], object], text: str) -> str:
    with pytest.raises((argparse.ArgumentTypeError, ValueError)) as caught:
        parse(text)
    message = str(caught.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("text", ["0", "-1", str(10**12), "1.5", "x", ""])
def test_counts_refuse_zero_negative_huge_and_text(text: str) -> None:
    refused(arg_types.positive, text)


def test_counts_take_what_a_run_uses() -> None:
    assert arg_types.positive("100") == 100
    assert arg_types.processes("4") == 4
    assert arg_types.non_negative("0") == 0  # --eval-every 0 turns the curve off
    refused(arg_types.processes, "0")  # `dapo up --rollouts 0` used to start and hang
    refused(arg_types.processes, "100000")
    refused(arg_types.seed_value, "-1")


@pytest.mark.parametrize("text", ["-5", "0", "nan", "inf", "-inf", "1e300", "soon"])
def test_stall_after_is_a_finite_positive_time(text: str) -> None:
    refused(arg_types.seconds(allow_zero=False), text)


def test_stall_timeout_zero_means_never() -> None:
    assert arg_types.seconds(allow_zero=True)("0") == 0.0
    assert arg_types.seconds(allow_zero=False)("2.5") == 2.5
    refused(arg_types.seconds(allow_zero=True), "-0.1")


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("notaurl", "scheme must be one of redis://"),
        ("http://127.0.0.1:6379/0", "scheme"),
        ("redis://:6379/0", "no host"),
        ("redis://127.0.0.1:99999/0", "out of range"),
        ("redis://127.0.0.1:x/0", "not a Redis URL"),
        ("redis://127.0.0.1:0/0", "port 0"),
        ("unix://", "no socket path"),
        ("", "scheme"),
        ("redis://[::1/0", "not a Redis URL"),
    ],
)
def test_malformed_redis_urls(text: str, needle: str) -> None:
    assert needle in refused(arg_types.redis_url, text)


@pytest.mark.parametrize(
    "text", ["redis://127.0.0.1:6379/0", "rediss://:pw@host:6380", "unix:///tmp/r.sock"]
)
def test_redis_urls_that_connect(text: str) -> None:
    assert arg_types.redis_url(text) == text


def test_output_dirs(tmp_path: Path) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert "not writable" in refused(cli_args.output_dir, UNWRITABLE)
    assert "is not a directory" in refused(cli_args.output_dir, str(a_file))
    assert "is not a directory" in refused(cli_args.output_dir, str(a_file / "below"))
    assert cli_args.output_dir(str(tmp_path / "new" / "deeper")) == str(tmp_path / "new/deeper")
    assert not (tmp_path / "new").exists()  # checked, not created
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # the probe file is gone


def test_a_path_that_cannot_be_looked_at_is_one_line(tmp_path: Path) -> None:
    assert "cannot use" in refused(cli_args.output_dir, "a\0b")
    assert "cannot use" in refused(cli_args.output_file, "a\0b")
    if os.geteuid() != 0:  # root may search any directory
        closed = tmp_path / "closed"
        closed.mkdir(mode=0o000)
        assert "cannot use" in refused(cli_args.output_dir, str(closed / "x" / "y"))
        closed.chmod(0o700)


def test_output_files(tmp_path: Path) -> None:
    assert "no directory" in refused(cli_args.output_file, f"{UNWRITABLE}/out.json")
    assert "is a directory" in refused(cli_args.output_file, str(tmp_path))
    assert cli_args.output_file(str(tmp_path / "out.json"))
    assert not (tmp_path / "out.json").exists()
    if os.geteuid() != 0:  # root may write a read-only file
        ro = tmp_path / "ro.json"
        ro.write_text("{}")
        ro.chmod(0o444)
        assert "not writable" in refused(cli_args.output_file, str(ro))


def test_rerender_needs_an_existing_directory(tmp_path: Path) -> None:
    refused(cli_args.existing_dir, str(tmp_path / "nope"))
    assert cli_args.existing_dir(str(tmp_path)) == str(tmp_path)


@pytest.mark.parametrize(
    ("content", "needle"),
    [(None, "table.json not found"), ("{", "not a `dapo ablate` table"), ("[]", "no plan")],
)
def test_rerender_without_a_table_is_one_line(
    tmp_path: Path, content: str | None, needle: str
) -> None:
    if content is not None:
        (tmp_path / "table.json").write_text(content)
    with pytest.raises(DapoError, match=needle):
        rerender(tmp_path)


def fake_model(path: Path, *files: str) -> Path:
    path.mkdir()
    for name in files:
        (path / name).write_text("{}")
    return path


def test_a_model_directory_needs_weights_and_a_tokenizer(tmp_path: Path) -> None:
    no_tokenizer = fake_model(tmp_path / "a", "config.json", "model.safetensors")
    problem = cli_args.model_dir_problem(no_tokenizer)
    assert problem is not None and "no tokenizer" in problem and "tokenizer.json" in problem
    no_weights = fake_model(tmp_path / "b", "config.json", "tokenizer.json")
    assert "no weights" in str(cli_args.model_dir_problem(no_weights))
    assert "no config.json" in str(cli_args.model_dir_problem(fake_model(tmp_path / "c")))
    assert "not found" in str(cli_args.model_dir_problem(tmp_path / "d"))
    whole = fake_model(tmp_path / "e", "config.json", "model.safetensors", "tokenizer.json")
    assert cli_args.model_dir_problem(whole) is None


def test_a_missing_vllm_venv_says_how_to_build_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # no .venv-vllm here
    config = load_config(preset="tiny_vllm", env={})
    with pytest.raises(DapoError, match=r"make \.venv-vllm/\.installed"):
        cli_args.preflight_up(config, str(tmp_path / "run"))
    assert list(tmp_path.iterdir()) == []  # nothing was started or written


def test_preflight_up_refuses_a_run_dir_it_cannot_write(tmp_path: Path) -> None:
    config = load_config(preset="tiny", env={})
    with pytest.raises(DapoError, match="not writable"):
        cli_args.preflight_up(config, UNWRITABLE)


def test_preflight_up_refuses_a_model_without_a_tokenizer(tmp_path: Path) -> None:
    model = fake_model(tmp_path / "m", "config.json", "model.safetensors")
    sets = [f"shared.model_path={model}", "shared.model_init=null"]
    config = load_config(preset="tiny", env={}, overrides=sets)
    with pytest.raises(DapoError, match="no tokenizer"):
        cli_args.preflight_up(config, str(tmp_path / "run"))


def test_a_refused_config_value_is_a_users_mistake() -> None:
    config = load_config(preset="tiny", env={})
    with pytest.raises(Exception) as caught:
        config.learner.total_steps = 0  # what `dapo up --steps 0` did
    message = cli_args.user_error(caught.value)
    assert message is not None and "total_steps" in message and "\n" not in message
    assert "pydantic.dev" not in message
    assert cli_args.user_error(RuntimeError("a bug")) is None
    assert cli_args.user_error(DapoError("bad")) == "bad"


def run_main(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as exc:
            code = int(exc.code or 0)
    return code, out.getvalue(), err.getvalue()


def test_up_help_lists_every_preset() -> None:
    code, out, _ = run_main("up", "--help")
    assert code == 0
    text = " ".join(out.split())
    for name in PRESETS:
        assert name in text, name


def test_ablate_help_lists_every_ablation_preset() -> None:
    from services.tools.ablation_plan import ABLATE_PRESETS

    code, out, _ = run_main("ablate", "--help")
    text = " ".join(out.split())
    assert code == 0 and all(name in text for name in ABLATE_PRESETS), text


def test_init_model_help_lists_every_model_preset() -> None:
    from learner.init_model import PRESETS as MODEL_PRESETS

    assert set(cli_args.MODEL_PRESETS) == set(MODEL_PRESETS)
    code, out, _ = run_main("init-model", "--help")
    text = " ".join(out.split())
    assert code == 0 and all(name in text for name in MODEL_PRESETS), text


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["up", "--steps", "0"], "argument --steps: must be in [1,"),
        (["up", "--rollouts", "0"], "argument --rollouts"),
        (["up", "--rollouts", "-1"], "argument --rollouts"),
        (["up", "--stall-after", "-5"], "argument --stall-after"),
        (["up", "--run-dir", UNWRITABLE], "argument --run-dir: cannot write"),
        (["init-model", "--out", UNWRITABLE], "argument --out: cannot write"),
        (["ledger", "--redis-url", "notaurl"], "argument --redis-url: not a Redis URL"),
        (["buffer", "--redis-url", "notaurl"], "argument --redis-url: not a Redis URL"),
        (["ablate", "--out-root", UNWRITABLE], "argument --out-root: cannot write"),
        (["ablate", "--seeds", "0"], "argument --seeds"),
        (["ablate", "--rerender", "/nonexistent/ablate-x"], "is not a directory"),
    ],
)
def test_a_bad_flag_is_refused_at_parse_time(argv: list[str], needle: str) -> None:
    code, _, err = run_main(*argv)
    assert code == 2
    assert err.count("\n") == 1 and needle in err, err


def test_a_run_dir_that_is_a_file(tmp_path: Path) -> None:
    a_file = tmp_path / "run"
    a_file.write_text("")
    code, _, err = run_main("up", "--run-dir", str(a_file))
    assert code == 2 and "exists and is not a directory" in err and err.count("\n") == 1


def test_eval_checks_its_output_and_model_before_any_work(tmp_path: Path) -> None:
    model = fake_model(tmp_path / "m", "config.json", "model.safetensors", "tokenizer.json")
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 256}))
    base = ["eval", "--model", str(model), "--data", str(tmp_path / "absent.jsonl")]
    code, _, err = run_main(*base, "--max-tokens", "4", "--out", f"{UNWRITABLE}/out.json")
    # refused before the data is read (the data file does not even exist)
    assert code == 2 and "--out: cannot write" in err and err.count("\n") == 1, err
    (model / "tokenizer.json").unlink()
    code, _, err = run_main(*base, "--max-tokens", "4")
    assert code == 2 and "no tokenizer" in err, err
