"""Every `dapo` subcommand run with generated bad flag values (negative, zero, huge, not a
number, a file where a directory is expected, an unwritable path, a malformed URL), one
process per case: each exits 2 with exactly one line on stderr that names the flag or
the value, no traceback, before any work starts, and leaves no process behind. Then the
command lines the issue found escaping as a traceback, raw text or a hang."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
from dapo_cli import DAPO
from fuzzing import Counter, cases
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from services.common.net import free_port
from services.common.presets import PRESETS

CASES_PER_COMMAND = 2  # x every flag, one process each: 85 processes of about a second
CASE_TIMEOUT_S = 60  # a refusal takes a second or two; past this the case hung
UNWRITABLE = "/proc/dapo-no/such"  # /proc refuses a new file even to root

HUGE = st.integers(10**10, 10**30)
NOT_A_NUMBER = st.sampled_from(["x", "1e", "one", "0x", ""])


def ints(low: int) -> st.SearchStrategy[str]:
    """Integers below `low` (zero and negative for a count), huge, or not a number."""
    return st.one_of(st.integers(-(10**12), low - 1), HUGE, NOT_A_NUMBER).map(str)


def times(allow_zero: bool) -> st.SearchStrategy[str]:
    """Negative (or zero), not finite, huge, or not a number of seconds."""
    bad = st.floats(max_value=-1e-3) if allow_zero else st.floats(max_value=0.0)
    special = st.sampled_from(["nan", "inf", "-inf", "1e300"])
    return st.one_of(bad.filter(lambda x: x == x), special, NOT_A_NUMBER).map(str)


URLS = st.one_of(
    st.sampled_from(
        [
            "notaurl",
            "http://127.0.0.1:6379/0",
            "redis//127.0.0.1",
            "redis://",
            "redis://127.0.0.1:99999/0",
            "redis://127.0.0.1:x/0",
            "redis://[::1/0",
            "unix://",
        ]
    ),
    st.text(st.characters(codec="ascii", exclude_categories=["Cc"]), max_size=12).filter(
        lambda t: "://" not in t
    ),
)
PORTS = st.one_of(st.integers(-(10**6), -1), st.integers(65536, 10**12)).map(str)
NAMES = st.text("abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=10)


@dataclass(frozen=True)
class Command:
    """A subcommand's valid base command line and, per flag, its bad values."""

    base: list[str]
    flags: dict[str, st.SearchStrategy[str]]
    cases: int = CASES_PER_COMMAND


def paths(tmp: Path, *kinds: str) -> st.SearchStrategy[str]:
    """Bad paths: a file where a directory is expected, below a file, unwritable, absent,
    an empty directory where a file is expected."""
    (tmp / "a_file").write_text("x")
    (tmp / "empty_dir").mkdir(exist_ok=True)
    table = {
        "file": str(tmp / "a_file"),
        "below_file": str(tmp / "a_file" / "below"),
        "unwritable": UNWRITABLE,
        "unwritable_file": f"{UNWRITABLE}/out.json",
        "absent": str(tmp / "absent" / "x"),
        "dir": str(tmp / "empty_dir"),
    }
    return st.sampled_from([table[k] for k in kinds])


def commands(tmp: Path, model: Path) -> dict[str, Command]:
    unreachable = f"redis://127.0.0.1:{free_port()}/0"
    out_dir = paths(tmp, "file", "below_file", "unwritable")
    config_file = paths(tmp, "dir", "absent", "unwritable_file")
    service = {
        "--redis-url": URLS,
        "--grpc-port": PORTS,
        "--http-port": PORTS,
        "--config": config_file,
        "--preset": NAMES.filter(lambda n: n not in PRESETS),
    }
    roles = {  # one parser for the five (services/common/entry.py): one case each
        role: Command([role, "--redis-url", unreachable], service, cases=1)
        for role in ("controller", "buffer", "reward", "rollout", "learner")
    }
    return {
        **roles,
        "up": Command(
            ["up", "--preset", "tiny", "--set", f"shared.model_path={model}"]
            + ["--run-dir", str(tmp / "run"), "--steps", "1"],
            {
                "--steps": ints(1),
                "--rollouts": ints(1),
                "--learner-ranks": ints(1),
                "--eval-every": ints(0),
                "--stall-after": times(allow_zero=False),
                "--stall-timeout": times(allow_zero=True),
                "--run-dir": out_dir,
                "--redis-url": URLS,
                "--config": config_file,
            },
        ),
        "ablate": Command(
            ["ablate", "--out-root", str(tmp / "ablate"), "--seeds", "1", "--steps", "1"],
            {
                "--seeds": ints(1),
                "--steps": ints(1),
                "--eval-every": ints(1),
                "--out-root": out_dir,
                "--rerender": paths(tmp, "file", "absent", "dir"),
            },
        ),
        "init-model": Command(
            ["init-model", "--out", str(tmp / "model")],
            {
                "--out": out_dir,
                "--seed": st.one_of(st.integers(max_value=-1).map(str), NOT_A_NUMBER),
            },
        ),
        "ledger": Command(
            ["ledger", "--redis-url", unreachable],
            {"--redis-url": URLS, "--run": paths(tmp, "file", "absent", "dir", "unwritable")},
        ),
        "eval": Command(
            ["eval", "--model", str(model), "--data", "synthetic:max3", "--max-tokens", "4"]
            + ["--limit", "2", "--n", "2"],
            {
                "--n": ints(1),
                "--max-tokens": ints(1),
                "--limit": st.one_of(st.integers(-(10**6), 0).map(str), NOT_A_NUMBER),
                "--seed": st.one_of(st.integers(max_value=-1), HUGE).map(str),
                "--temperature": st.sampled_from(["-1", "nan", "inf", "x"]),
                "--top-p": st.sampled_from(["0", "-0.5", "1.5", "nan", "x"]),
                "--out": paths(tmp, "dir", "unwritable_file", "below_file"),
                "--model": paths(tmp, "file", "absent", "dir"),
            },
        ),
        "config": Command(
            ["config", "show", "--preset", "tiny"],
            {
                "--config": config_file,
                "--format": NAMES.filter(lambda n: n not in ("yaml", "json")),
                "--preset": NAMES.filter(lambda n: n not in PRESETS),
            },
        ),
    }


MARK_VAR = "DAPO_CLI_FUZZ_CASE"  # inherited by whatever a case starts, however it detaches


def marked_processes(mark: str) -> list[int]:
    """Pids of live processes whose environment carries `mark` (a launched service starts
    a session of its own, so a process group would miss it)."""
    needle = f"{MARK_VAR}={mark}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            found = entry.name.isdigit() and needle in (entry / "environ").read_bytes()
            alive = found and (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:  # gone, or not ours to read
            continue
        if alive:
            pids.append(int(entry.name))
    return pids


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def run_case(argv: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """`argv`, killed with all it started past CASE_TIMEOUT_S. Fails if anything it
    started is still running once it has exited."""
    mark = uuid.uuid4().hex
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        env={**os.environ, MARK_VAR: mark},
    )
    try:
        out, err = proc.communicate(timeout=CASE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        kill_all([proc.pid, *marked_processes(mark)])
        proc.communicate()
        kill_all(marked_processes(mark))
        pytest.fail(f"still running after {CASE_TIMEOUT_S} s: {' '.join(argv)}")
    left = marked_processes(mark)
    deadline = time.monotonic() + 5
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = marked_processes(mark)
    if left:
        kill_all(left)
        pytest.fail(f"left processes {left} behind: {' '.join(argv)}")
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def assert_refused(result: subprocess.CompletedProcess[str], *needles: str) -> str:
    """Exit 2, one line on stderr, no traceback, mentioning one of `needles`."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    shown = f"{' '.join(result.args[3:])}\n{result.stderr[-2000:]}"
    assert result.returncode == 2, shown
    assert len(lines) == 1 and "Traceback" not in result.stderr, shown
    assert not needles or any(n in lines[0] for n in needles), shown
    return lines[0]


def flag_names(flag: str) -> tuple[str, ...]:
    """How a message may name a flag: `--max-tokens`, `max_tokens`, `max-tokens`."""
    bare = flag.removeprefix("--")
    return flag, bare, bare.replace("-", "_")


@pytest.fixture(scope="module")
def fuzz_commands(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> dict[str, Command]:
    return commands(tmp_path_factory.mktemp("cli-fuzz"), tiny_model)


@pytest.mark.parametrize(
    "name",
    ["up", "ablate", "init-model", "ledger", "eval", "config", "controller", "buffer"]
    + ["reward", "rollout", "learner"],
)
def test_every_bad_flag_value_is_one_line_and_exit_2(
    name: str, fuzz_commands: dict[str, Command]
) -> None:
    command = fuzz_commands[name]
    ran = Counter()

    # No shrinking: a failing case may be one that hangs until CASE_TIMEOUT_S.
    @settings(cases(command.cases), phases=[Phase.generate])
    @given(values=st.fixed_dictionaries(command.flags))
    def check(values: dict[str, str]) -> None:
        ran()
        for flag, value in values.items():  # every flag in each case, one process each
            result = run_case([*DAPO, *command.base, f"{flag}={value}"])
            assert_refused(result, *flag_names(flag), value)

    check()
    assert ran.n >= command.cases


def test_bench_with_a_bad_name_is_one_line() -> None:
    ran = Counter()

    @cases(5)
    @given(name=NAMES)
    def check(name: str) -> None:
        ran()
        assert_refused(run_case([*DAPO, "bench", f"no_{name}"]), f"no_{name}")

    check()
    assert ran.n >= 5


def broken_model(tmp_path: Path, tiny_model: Path) -> Path:
    """The tiny model's weights and config without its tokenizer files."""
    model = tmp_path / "no-tokenizer"
    model.mkdir()
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        (model / name).write_bytes((tiny_model / name).read_bytes())
    return model


def issue_cases(tmp: Path, tiny_model: Path) -> list[tuple[list[str], str]]:
    """The command lines issue 38 found escaping, each with what its one line must say."""
    a_file = tmp / "a_file"
    a_file.write_text("x")
    (tmp / "no-table").mkdir()
    model = broken_model(tmp, tiny_model)
    no_tokenizer = ["--set", f"shared.model_path={model}", "--set", "shared.model_init=null"]
    # a run as users start one, so that a value the launcher accepts starts it (and hangs)
    run = [
        "--preset",
        "tiny",
        "--set",
        f"shared.model_path={tiny_model}",
        "--run-dir",
        str(tmp / "run"),
    ]
    eval_base = ["eval", "--data", "synthetic:max3", "--max-tokens", "4", "--limit", "2"]
    return [
        (["up", "--rollouts", "0", *run], "--rollouts"),
        (["up", "--rollouts", "-1", *run], "--rollouts"),
        (["up", "--steps", "0", *run], "--steps"),
        (["up", *run, "--run-dir", UNWRITABLE], "--run-dir"),
        (["up", *run, "--run-dir", str(a_file)], "not a directory"),
        (["up", "--stall-after", "-5", *run], "--stall-after"),
        (["up", *run, *no_tokenizer], "no tokenizer"),
        (["init-model", "--out", UNWRITABLE], "--out"),
        (["ledger", "--redis-url", "notaurl"], "--redis-url: not a Redis URL"),
        (["ablate", "--rerender", str(tmp / "no-table")], "table.json not found"),
        (["ablate", "--out-root", UNWRITABLE], "--out-root"),
        ([*eval_base, "--model", str(tiny_model), "--out", f"{UNWRITABLE}/out.json"], "--out"),
        ([*eval_base, "--model", str(model)], "no tokenizer"),
        # the README's first try, before it named --max-tokens: refused before any work
        (["eval", "--model", str(tiny_model), "--data", "synthetic:max3"], "--max-tokens 1024"),
    ]


def test_what_issue_38_found_is_one_line_before_any_work(tmp_path: Path, tiny_model: Path) -> None:
    for argv, needle in issue_cases(tmp_path, tiny_model):
        started = time.monotonic()
        assert_refused(run_case([*DAPO, *argv]), needle)
        assert time.monotonic() - started < CASE_TIMEOUT_S
    assert not (tmp_path / "run").exists()  # refused before the run directory was made


def test_a_missing_vllm_venv_is_found_before_anything_starts(tmp_path: Path) -> None:
    result = run_case([*DAPO, "up", "--preset", "tiny_vllm", "--steps", "1"], cwd=tmp_path)
    assert_refused(result, "make .venv-vllm/.installed")
    assert list(tmp_path.iterdir()) == []  # no model built, no run directory, no Redis data


def test_a_detached_leftover_is_seen() -> None:
    """The leftover check finds a process that left the case's session, closed its pipes
    (a service logging to a file) and outlived it."""
    spawn = (
        "import subprocess as s, sys; "
        "s.Popen(['sleep', '30'], start_new_session=True, stdout=s.DEVNULL, stderr=s.DEVNULL); "
        "sys.exit(2)"
    )
    with pytest.raises(pytest.fail.Exception, match="left processes"):
        run_case([sys.executable, "-c", spawn])


def test_up_help_lists_every_preset() -> None:
    result = run_case([*DAPO, "up", "--help"])
    text = " ".join(result.stdout.split())
    assert result.returncode == 0
    assert all(name in text for name in PRESETS), text
