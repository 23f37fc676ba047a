"""A run's life as its user lives it (docs/runs.md): stopped by a closed terminal (SIGHUP)
and by two Ctrl-C, resumed with a changed lr (a changed group size refused), finished with
one report and one ledger across its segments; `dapo eval --run` names the checkpoint it
evaluates and equals the run's own eval_after; `--fresh` moves the run aside and a learner
killed in the reused directory never loads the old run's checkpoint; two runs on one
external Redis do not mix. The last segment SIGKILLs one service drawn at random (chaos)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import redis
from dapo_cli import dapo, popen_as_typed, set_args
from run_audit import assert_trained_once, children_of, role_process, wait_for

from services.common.redis_server import start_redis
from services.tools.cli import up_argv

pytestmark = pytest.mark.slow

STEPS = 8
SETS = [
    "controller.eval.every_steps=3",
    "controller.eval.limit=8",
    "controller.eval.n=4",
    "learner.checkpoint.every=1000",  # only the checkpoints on stop and at the end
]


def logged_steps(run_dir: Path) -> list[int]:
    log = run_dir / "logs" / "learner.log"
    text = log.read_text() if log.exists() else ""
    return [int(m) for m in re.findall(r"step=(\d+) loss=", text)]


def complete(run_dir: Path) -> list[int]:
    """The steps whose checkpoint the learner logged whole (a background write done)."""
    log = run_dir / "logs" / "learner.log"
    text = log.read_text() if log.exists() else ""
    return [int(m) for m in re.findall(r"checkpoint step(\d+) complete", text)]


def run(
    argv: list[str], env: dict[str, str], timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)


class Job:
    """`dapo up` in its own process group, as a terminal's foreground job; its stdout and
    stderr go to files (a pipe nobody reads would block it)."""

    def __init__(
        self, run_dir: Path, model: Path, env: dict[str, str], name: str, *extra: str
    ) -> None:
        argv = [*up_argv(run_dir, model), "--steps", str(STEPS), *set_args(SETS), *extra]
        self.out, self.err = (run_dir.parent / f"{name}.{k}" for k in ("out", "err"))
        with self.out.open("w") as out, self.err.open("w") as err:
            self.proc = popen_as_typed(
                argv, stdout=out, stderr=err, start_new_session=True, env=env
            )

    @property
    def stdout(self) -> str:
        return self.out.read_text()

    @property
    def stderr(self) -> str:
        return self.err.read_text()


def stop_at(job: Job, run_dir: Path, step: int, *signals: int) -> float:
    """Once the learner logged `step`, send `signals` (0.3 s apart) to the job's process
    group; the seconds from the first signal to the exit."""
    try:
        wait_for(lambda: max(logged_steps(run_dir), default=0) >= step, 180, f"step {step}")
        sent = time.monotonic()
        for sig in signals:
            os.killpg(job.proc.pid, sig)
            time.sleep(0.3)
        job.proc.wait(timeout=150)
        return time.monotonic() - sent
    finally:
        job.proc.kill()


def resume_args(lr: str) -> list[str]:
    return ["--resume", "--set", f"learner.optimizer.lr={lr}"]


@pytest.mark.timeout(600)
def test_a_run_stopped_twice_resumes_to_its_end_with_one_ledger_and_report(
    tmp_path: Path, tiny_model: Path, killed_tree_env: dict[str, str]
) -> None:
    run_dir, env = tmp_path / "run", killed_tree_env

    # A closed terminal: SIGHUP to the job. Checkpoint, report, exit 129.
    first = Job(run_dir, tiny_model, env, "first")
    took = stop_at(first, run_dir, 2, signal.SIGHUP)
    assert first.proc.returncode == 129, first.stderr[-3000:]
    assert took < 60 and not children_of(run_dir)
    report = json.loads((run_dir / "report.json").read_text())
    stopped = report["checkpoint_step"]
    assert stopped == max(logged_steps(run_dir)) >= 2 and report["exit_code"] == 129
    run_id = report["run_id"]

    # `dapo eval --run` of an interrupted run: its latest checkpoint, named.
    result = dapo("eval", "--run", str(run_dir), "--n", "2", "--limit", "8")
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"'s step{stopped} (step {stopped}, policy version {stopped})" in result.stderr
    evaluated = json.loads(result.stdout)
    assert (evaluated["checkpoint"], evaluated["version"]) == (f"step{stopped}", stopped)

    # The same command again refuses; a changed group size is refused on resume.
    up = [*up_argv(run_dir, tiny_model), "--steps", str(STEPS), *set_args(SETS)]
    again = run(up, env)
    lines = again.stderr.strip().splitlines()
    assert again.returncode == 2 and len(lines) == 1, again.stderr[-2000:]
    assert f"holds run tiny (id {run_id}, stopped at step {stopped} of {STEPS})" in lines[0]
    assert "--resume" in lines[0] and "--fresh" in lines[0]
    changed = run([*up, "--resume", "--set", "shared.group_size=8"], env)
    lines = changed.stderr.strip().splitlines()
    assert changed.returncode == 2 and len(lines) == 1, changed.stderr[-2000:]
    assert "shared.group_size 16 → 8" in lines[0] and "--fresh" in lines[0]

    # Resumed with a new lr (printed, applied), then stopped by two Ctrl-C: one line.
    second = Job(run_dir, tiny_model, env, "second", *resume_args("0.0002"))
    stop_at(second, run_dir, stopped + 2, signal.SIGINT, signal.SIGINT)
    out, err = second.stdout, second.stderr
    assert second.proc.returncode == 130, err[-3000:]
    assert "changed on resume: learner.optimizer.lr 0.0005 → 0.0002" in out
    assert f"resuming run tiny (id {run_id}) from its checkpoint step{stopped}" in out
    assert len([line for line in err.splitlines() if "stopping now" in line]) == 1, err[-2000:]
    assert not children_of(run_dir)

    # Resumed again to the end: one report and one ledger across the three segments.
    # ... with one service, drawn at random, SIGKILLed on the way (the chaos variant).
    third = Job(run_dir, tiny_model, env, "third", *resume_args("0.0002"))
    victim = random.Random().choice(["controller", "buffer", "reward", "rollout", "learner"])
    try:
        past = lambda: max(logged_steps(run_dir), default=0) > stopped + 2  # noqa: E731
        wait_for(lambda: past() or third.proc.poll() is not None, 180, "a resumed step")
        if third.proc.poll() is None:
            with contextlib.suppress(StopIteration):  # the run may end as we look
                role_process(run_dir, victim).kill()
        third.proc.wait(timeout=300)
    finally:
        third.proc.kill()
    assert third.proc.returncode == 0, f"{victim} killed: {third.stderr[-3000:]}"
    report = json.loads((run_dir / "report.json").read_text())
    assert report["run_id"] == run_id and report["ledger"]["ok"]
    assert [s["exit_code"] for s in report["segments"]] == [129, 130, 0]
    assert report["segments"][1]["start_step"] == stopped
    assert report["ledger"]["trained"] == STEPS * 16
    assert {s["step"] for s in report["steps"]} == set(range(1, STEPS + 1))
    lrs = {s["step"]: s["lr"] for s in report["steps"]}
    assert lrs[stopped] == pytest.approx(5e-4) and lrs[STEPS] == pytest.approx(2e-4)
    # The curve goes on across segments: no version evaluated twice. (A point still being
    # sampled when a segment stops is cut, so which versions made it is timing's business.)
    versions = [p["version"] for p in report["eval_curve"]]
    assert versions == sorted(set(versions)) and len(versions) >= 2, versions
    ledger = dapo("ledger", "--run", str(run_dir), "--json")
    assert json.loads(ledger.stdout) == report["ledger"]
    with_redis_trained_once(run_dir)

    # `dapo eval --run` of the finished run: its final model, the number eval_after has.
    result = dapo("eval", "--run", str(run_dir))
    assert result.returncode == 0, result.stderr[-2000:]
    evaluated, after = json.loads(result.stdout), report["eval_after"]
    assert evaluated["checkpoint"] == "final" and evaluated["version"] == after["version"]
    assert evaluated["avg@4"] == after["avg@4"]


def with_redis_trained_once(run_dir: Path) -> None:
    """Every step of the run is in the final model once, each group trained once."""
    from services.tools.run_dir import run_redis

    with run_redis(run_dir) as config:
        assert config.shared.redis_url
        client = redis.Redis.from_url(config.shared.redis_url)
        assert_trained_once(client, "tiny", STEPS, 16)
        client.close()


def test_fresh_moves_a_run_aside_and_a_killed_learner_resumes_only_its_own_run(
    tmp_path: Path, tiny_model: Path, killed_tree_env: dict[str, str]
) -> None:
    """The old run's checkpoint (step 3) is moved aside with it; the new run's learner,
    SIGKILLed once its step-2 checkpoint is whole (written in the background), resumes
    from the new run's own checkpoint."""
    run_dir, env = tmp_path / "run", killed_tree_env
    old = Job(
        run_dir, tiny_model, env, "old", "--steps", "3", "--set", "controller.eval.enabled=false"
    )
    old.proc.wait(timeout=180)
    assert old.proc.returncode == 0, old.stderr[-3000:]
    run_id = json.loads((run_dir / "run.json").read_text())["run_id"]
    every = ["--set", "learner.checkpoint.every=1", "--set", "controller.eval.enabled=false"]
    fresh = Job(run_dir, tiny_model, env, "fresh", "--fresh", "--steps", "5", *every)
    try:
        moved = lambda: any(tmp_path.glob("run.old-*"))  # noqa: E731
        wait_for(lambda: moved() and max(complete(run_dir), default=0) >= 2, 180, "step 2")
        role_process(run_dir, "learner").kill()
        fresh.proc.wait(timeout=180)
    finally:
        fresh.proc.kill()
    assert fresh.proc.returncode == 0, fresh.stderr[-3000:]
    (aside,) = tmp_path.glob("run.old-*")
    assert json.loads((aside / "run.json").read_text())["run_id"] == run_id
    assert (aside / "checkpoints" / "final" / "config.json").is_file()
    report = json.loads((run_dir / "report.json").read_text())
    assert report["run_id"] != run_id and report["ledger"]["ok"]
    assert report["ledger"]["trained"] == 5 * 16
    resumed = re.findall(r"resumed step=(\d+)", (run_dir / "logs" / "learner.log").read_text())
    assert resumed and all(2 <= int(n) < 5 for n in resumed), resumed
    # The moved run is still evaluable: its config names the new run's checkpoints
    # (`run/checkpoints`), its own are inside it.
    result = dapo("eval", "--run", str(aside), "--n", "2", "--limit", "8")
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout)["version"] == 3


def test_two_runs_on_one_redis_do_not_mix(
    tmp_path: Path, tiny_model: Path, killed_tree_env: dict[str, str]
) -> None:
    server = start_redis()
    try:
        no_eval = ["--set", "controller.eval.enabled=false"]
        quick = ["--steps", "2", "--redis-url", server.url, *no_eval]
        env = killed_tree_env
        first = run([*up_argv(tmp_path / "a", tiny_model), *quick], env)
        assert first.returncode == 0, first.stderr[-2000:]
        run_id = json.loads((tmp_path / "a" / "run.json").read_text())["run_id"]
        second = run([*up_argv(tmp_path / "b", tiny_model), *quick], env)
        lines = second.stderr.strip().splitlines()
        assert second.returncode == 2 and len(lines) == 1, second.stderr[-2000:]
        assert f"already holds run tiny (id {run_id})" in lines[0]
        assert "--set shared.run_name=NAME" in lines[0]
        assert not (tmp_path / "b" / "report.json").exists()
        own = [*quick, "--set", "shared.run_name=other"]
        third = run([*up_argv(tmp_path / "b", tiny_model), *own], env)
        assert third.returncode == 0, third.stderr[-2000:]
        for name, run_dir in (("tiny", tmp_path / "a"), ("other", tmp_path / "b")):
            report = json.loads((run_dir / "report.json").read_text())
            assert report["run"] == name and report["ledger"]["ok"]
            assert report["ledger"]["trained"] == 2 * 16
    finally:
        server.stop()
