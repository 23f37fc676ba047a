"""`dapo up`: Redis plus the five services as separate OS processes on this machine.

Each service is `python -m services.tools.cli <role> --config <run>/config.yaml` with ports 0
(picked free and printed), registering itself in Redis so the others find it. The
launcher shows a progress bar from the learner's metrics stream and supervises: a child
that dies is started again (up to `max_restarts` times) and resumes from the run's state
in Redis. It stops everything on Ctrl-C, SIGTERM or SIGHUP (a second one hurries) or when
the learner reports the last step, and writes `<run>/report.json`. No child outlives it:
each gets SIGTERM, then SIGKILL. `--resume`/`--fresh` and the run's id: resume.py.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import redis

from services.common.adapters import decode_group
from services.common.errors import DapoError
from services.common.keys import RunKeys
from services.common.ledger import read_ledger
from services.common.lifecycle import PARENT_ENV
from services.common.redis_server import RedisServer, connect, connect_run, start_redis
from services.common.security import secret_env, without_secrets
from services.tools import checks
from services.tools.config import DapoConfig, dump_config
from services.tools.cpu_meter import CpuMeter
from services.tools.evaluate import eval_plan, run_eval_plan
from services.tools.gpus import launch_gpus
from services.tools.liveness import StallWatch, run_failure
from services.tools.report import (
    kept_ratios,
    sampling_summary,
    save_report,
    summary_lines,
    time_accounting,
    write_plots,
)
from services.tools.resume import Mode, Segment, begin, record_segment
from services.tools.run_dir import RunLock, latest_checkpoint_step, redis_dir

log = logging.getLogger(__name__)

ROLES = ("reward", "learner", "rollout", "buffer", "controller")
STALL_AFTER_S = 30.0


@dataclass
class Child:
    role: str
    proc: subprocess.Popen
    log_file: IO[bytes]
    name: str = ""
    restarts: int = 0
    extra: tuple[str, ...] = ()  # its own command-line settings, kept across restarts

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def log_path(self) -> Path:
        return Path(self.log_file.name)


@dataclass
class Launch:
    """The processes and Redis of one `dapo up`."""

    config: DapoConfig
    run_dir: Path
    redis_server: RedisServer | None = None
    children: list[Child] = field(default_factory=list)
    history: list[dict[str, int]] = field(default_factory=list)
    max_restarts: int = 3
    evals: dict[str, Any] = field(default_factory=dict)
    # Called from the monitor loop with (launch, last step seen, run done); e.g. the
    # ablation's held-out evaluations while training goes on.
    on_step: Callable[[Launch, int, bool], None] | None = None
    # Shows stalls and their causes; stops a run a service gave up on (liveness.py).
    watch: StallWatch = field(default_factory=lambda: StallWatch(STALL_AFTER_S))
    failure: str | None = None  # why the run stopped, when it did not finish
    segment: Segment | None = None  # which run this is, from which step (resume.py)
    claimed: bool = False  # the Redis key space is this run's: its report may be written
    signum: int | None = None  # the stop signal received (SIGINT: None)
    hurry: bool = False  # a second stop signal: no checkpoint wait, no report
    gpus: dict[str, str] = field(default_factory=dict)  # child → CUDA_VISIBLE_DEVICES
    cpu: CpuMeter = field(default_factory=CpuMeter)  # CPU per step by role (the summary)

    @property
    def config_path(self) -> Path:
        """The resolved config every child reads (written by `prepare`)."""
        return self.run_dir / "config.yaml"

    def spawn(
        self, role: str, name: str, extra: tuple[str, ...] = ()
    ) -> tuple[subprocess.Popen, IO[bytes]]:
        log_file = (self.run_dir / "logs" / f"{name}.log").open("ab")
        env = {**child_env(), **secret_env(self.config.security, self.config.shared.redis_url)}
        if name in self.gpus:
            env["CUDA_VISIBLE_DEVICES"] = self.gpus[name]
        proc = subprocess.Popen(
            [
                role_python(self.config, role),
                "-m",
                "services.tools.cli",
                role,
                "--config",
                str(self.config_path),
                *extra,
            ],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        return proc, log_file

    def start_child(self, role: str, name: str | None = None, extra: tuple[str, ...] = ()) -> None:
        proc, log_file = self.spawn(role, name or role, extra)
        self.children.append(Child(role, proc, log_file, name or role, extra=extra))

    def start_all(self, rollouts: int) -> None:
        """Every service once, and `rollouts` rollout servers."""
        cores = rollout_cores(self.config, rollouts)
        self.gpus = launch_gpus(self.config, rollouts)
        for role in ROLES:
            if role != "rollout":
                self.start_child(role)
            for i in range(rollouts if role == "rollout" else 0):
                extra = ("--set", f"rollout.engine.cpu_cores={cores[i]}") if cores else ()
                self.start_child(role, "rollout" if rollouts == 1 else f"rollout-{i}", extra)

    def role_pids(self) -> dict[str, list[int]]:
        """Each role's process roots, Redis's and this process's (`dapo up`)."""
        pids: dict[str, list[int]] = {"dapo up": [os.getpid()]}
        for child in self.children:
            pids.setdefault(child.role, []).append(child.pid)
        if self.redis_server is not None:
            pids["redis"] = [self.redis_server.proc.pid]
        return pids

    def model_cpu(self) -> float | None:
        """The rollout servers' model CPU seconds so far (None unless every one says)."""
        rollouts = [c for c in self.children if c.role == "rollout"]
        said = [(self.watch.status(c) or {}).get("model_cpu_s") for c in rollouts]
        known = [float(x) for x in said if x is not None]
        return sum(known) if rollouts and len(known) == len(rollouts) else None

    def dead_child(self) -> Child | None:
        return next((c for c in self.children if c.proc.poll() is not None), None)

    def restart(self, child: Child) -> None:
        """Start a dead child again (same role, same log); it resumes from Redis state.

        A learner also restores its latest checkpoint (only ever one of this run's: the
        checkpoint directory is stamped with the run id, learner/checkpoints.py).
        """
        child.log_file.close()
        resume = ("--set", "learner.checkpoint.resume=true") if child.role == "learner" else ()
        child.proc, child.log_file = self.spawn(child.role, child.name, child.extra + resume)
        child.restarts += 1

    def redis_died(self) -> bool:
        """True if our redis-server died; it is then started again from its AOF."""
        server = self.redis_server
        if server is None or server.proc.poll() is None:
            return False
        if not server.appendonly:
            raise DapoError("redis-server died and has no AOF to restart from (redis_appendonly)")
        server.restart()
        return True

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM every child, wait, SIGKILL stragglers, then stop Redis."""
        self.stop_children(grace_s)
        self.stop_redis()

    def stop_redis(self) -> None:
        if self.redis_server is not None:
            self.redis_server.stop()

    def stop_children(self, grace_s: float = 10.0) -> None:
        """SIGTERM every child, wait, SIGKILL stragglers. The learner gets its own grace
        (`learner.launch.shutdown_timeout_s`): it checkpoints on SIGTERM."""
        for child in self.children:
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        learner_grace = max(grace_s, self.config.learner.launch.shutdown_timeout_s + 5)
        for child in self.children:
            deadline = started + (learner_grace if child.role == "learner" else grace_s)
            while child.proc.poll() is None and time.monotonic() < deadline and not self.hurry:
                time.sleep(0.05)
            if child.proc.poll() is None:
                child.proc.kill()
                child.proc.wait()
            child.log_file.close()


def rollout_cores(config: DapoConfig, rollouts: int) -> list[str]:
    """Each vLLM rollout server's own cores (`rollout.engine.cpu_cores`), when several
    share this machine and none are configured: vLLM's 'auto' binds every one of them to
    the same first cores (two servers on one core, the others idle). Ignored by vLLM on
    GPU; empty for the torch engine, for one server, or when cores are configured."""
    engine = config.rollout.engine
    if engine.kind != "vllm" or engine.cpu_cores is not None or rollouts < 2:
        return []
    return core_shares(sorted(os.sched_getaffinity(0)), rollouts)


def core_shares(cores: list[int], parts: int) -> list[str]:
    """`cores` cut into `parts` contiguous shares (one core each, reused in turn, when
    there are fewer cores than parts), as comma lists."""
    if parts > len(cores):
        return [str(cores[i % len(cores)]) for i in range(parts)]
    bounds = [len(cores) * i // parts for i in range(parts + 1)]
    return [",".join(map(str, cores[a:b])) for a, b in zip(bounds, bounds[1:], strict=False)]


def role_python(config: DapoConfig, role: str) -> str:
    """The interpreter the role's config names (`<role>.server.python`), else ours."""
    python = getattr(config, role).server.python  # probe-ok: the role's config section
    if python is None:
        return sys.executable
    if shutil.which(python) is None:
        raise DapoError(f"{role}.server.python: {python} is not an interpreter here")
    return python


# torch.distributed launcher variables: a child of `dapo up` is a world of its own, even
# when `dapo up` itself runs inside a process that set them (a test, a torchrun job).
DIST_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
    env["PYTHONUNBUFFERED"] = "1"
    env[PARENT_ENV] = str(os.getpid())  # children exit if the launcher dies (even by SIGKILL)
    return env


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def stop_on_signals(state: Launch) -> dict[int, Any]:
    """SIGTERM and SIGHUP (a closed terminal) stop `dapo up` like Ctrl-C does, unless
    ignored (`nohup` ignores SIGHUP: the run then survives its terminal); returns the
    handlers it replaced (`launch` puts them back, so a caller such as a test keeps its own)."""

    def _handler(signum: int, frame: object) -> None:
        state.signum = signum
        raise KeyboardInterrupt

    previous: dict[int, Any] = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    for s in STOP_SIGNALS:
        if previous[s] is not signal.SIG_IGN:
            signal.signal(s, _handler)
    return previous


def hurry_on_signals(state: Launch) -> None:
    """While stopping, a second signal stops the services at once: one line says what that
    skips (the learner's checkpoint, the report); the run resumes from its last checkpoint."""

    def _handler(signum: int, frame: object) -> None:
        if state.hurry:
            return
        state.hurry = True
        step = latest_checkpoint_step(state.config)
        since = f"its last checkpoint (step {step})" if step else "the start (no checkpoint yet)"
        print(
            f"stopping now: no checkpoint of the current step, no report; `dapo up --resume` "
            f"continues from {since}",
            file=sys.stderr,
            flush=True,
        )

    for s in STOP_SIGNALS:
        if signal.getsignal(s) is not signal.SIG_IGN:
            signal.signal(s, _handler)


def ensure_model(config: DapoConfig) -> None:
    """Build the preset's random model if its directory is missing (demo, tests)."""
    path = config.model_path
    if path is None:
        raise DapoError("no model: set shared.model_path (or learner/rollout model_path)")
    preset = config.shared.model_init
    if Path(path).is_dir() and (preset is None or _model_is_current(path, preset)):
        return
    if preset is None:
        raise DapoError(f"model directory not found: {path}")
    from learner.init_model import init_model

    init_model(Path(path), preset=preset, seed=config.shared.seed)
    print(f"built a random {preset} model in {path}")


def _model_is_current(path: str, preset: str) -> bool:
    from learner.init_model import model_is_current

    if model_is_current(path, preset):
        return True
    print(f"{path} was built with an older {preset} tokenizer: rebuilding it")
    return False


def prepare(config: DapoConfig, run_dir: Path, launch: Launch, keep_redis: bool = False) -> None:
    """Start Redis if needed (from the run's own data when resuming) and write the
    resolved config every child reads."""
    updates: dict[str, Any] = {}
    if config.shared.redis_url is None:
        launch.redis_server = start_redis(
            appendonly=config.shared.redis_appendonly,
            password=config.security.redis.secret(),
            data_dir=redis_dir(run_dir, keep_redis),  # `dapo ledger --run` reads it later
        )
        updates["redis_url"] = launch.redis_server.url
    data = config.model_copy(update={"shared": config.shared.model_copy(update=updates)})
    if data.learner.checkpoint.dir is None:  # a restarted learner resumes from here
        data.learner.checkpoint.dir = str(run_dir / "checkpoints")
    for section in ROLES:
        server = getattr(data, section).server  # probe-ok: a role's config section by name
        server.grpc_port = server.http_port = 0
    # Inline secrets reach the children through their environment (spawn), not the file.
    file_data = data.model_copy(update={"security": without_secrets(data.security)})
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    launch.config_path.write_text(dump_config(file_data))
    launch.config = data


def claim_redis(config: DapoConfig, segment: Segment) -> None:
    """Stamp the run's id on its Redis key space: a new run only on an unused one, a
    resumed run only on its own (whose stop marks are cleared)."""
    client = connect_run(config)
    keys = RunKeys(config.shared.run_name)
    raw = client.get(keys.run_id)
    owner = raw.decode() if raw is not None else None
    if segment.resumed and owner != segment.run_id:
        held = f"run id {owner}" if owner else "no state of it"
        raise DapoError(
            f"the Redis at {redis_place(config)} holds {held}, not run {segment.run_id}: "
            "resume it with the Redis it ran on, or start a new run with --fresh"
        )
    used = owner is not None or client.exists(keys.version, keys.ledger, keys.metrics)
    if not segment.resumed and used:
        other = f"(id {owner})" if owner else "(of an older dapo up)"
        raise DapoError(
            f"the Redis at {redis_place(config)} already holds run {config.shared.run_name} "
            f"{other}: give this run its own key space (--set shared.run_name=NAME) or "
            "another Redis database (redis://HOST:PORT/N)"
        )
    client.delete(keys.done, keys.failed)
    client.set(keys.run_id, segment.run_id)


def redis_place(config: DapoConfig) -> str:
    """host:port/db of the run's Redis (never its password)."""
    from urllib.parse import urlsplit

    url = urlsplit(config.shared.redis_url or "")
    return f"{url.hostname}:{url.port}{url.path or ''}"


def last_metrics(client: Any, keys: RunKeys) -> dict[str, Any] | None:
    entries = client.xrevrange(keys.metrics, count=1)
    return json.loads(entries[0][1][b"json"]) if entries else None


def eval_curve(client: Any, keys: RunKeys) -> list[dict[str, Any]]:
    """The in-run eval points (the controller's `evals` stream), in the order made."""
    return [json.loads(f[b"json"]) for _, f in client.xrange(keys.evals)]


def monitor(launch: Launch) -> int:
    """Progress bar until the run is done, a child dies, or Ctrl-C; returns the exit code."""
    from tqdm import tqdm

    config = launch.config
    assert config.shared.redis_url
    # Fail fast while Redis is down: this loop is what restarts the launcher's own Redis.
    client = connect(config.shared.redis_url, config.security.redis, outage_s=1.0)
    keys = RunKeys(config.shared.run_name)
    total = config.learner.total_steps
    launch.watch.start()
    first = launch.segment.start_step if launch.segment else 0
    bar_args = {"desc": "dapo up", "unit": "step", "dynamic_ncols": True, "initial": first}
    with tqdm(total=total, **bar_args) as bar:
        while True:
            if launch.redis_died():
                bar.write("redis-server died; restarted it from its append-only file")
            try:
                done = bool(client.exists(keys.done))
                need = config.shared.train_batch_groups
                update_bar(bar, client, keys, config.shared.run_name, launch.history, need)
                launch.failure = None if done else stop_reason(launch, bar, client, keys)
            except redis.ConnectionError:  # Redis restarting: supervise, read it next time
                done = False
            if launch.failure is not None:
                bar.write(f"stopping the run: {launch.failure}")
                return 1
            dead = launch.dead_child()
            if dead is not None and not done and not supervise(launch, dead, bar):
                return 1
            if not done:
                launch.cpu.observe(bar.n, launch.role_pids, launch.model_cpu)
            if launch.on_step is not None:
                launch.on_step(launch, bar.n, done)
            if done:
                return 0
            time.sleep(0.2)


def stop_reason(launch: Launch, bar: Any, client: Any, keys: RunKeys) -> str | None:
    """Why the run must stop now (a service gave up on it, or the stall timeout), if so;
    shows a stall's cause on the way."""
    failure = run_failure(client, keys)
    if failure is not None:
        return failure
    line = launch.watch.observe(bar.n, launch.children, client, keys.run)
    if line is not None:
        bar.write(line)
    stalled = launch.watch.stalled_s(bar.n)
    desc = f"dapo up (no step for {stalled:.0f}s)" if stalled >= launch.watch.stall_after_s else ""
    if bar.desc != f"{desc or 'dapo up'}: ":
        bar.set_description(desc or "dapo up")
    return launch.watch.timed_out(bar.n)


def supervise(launch: Launch, dead: Child, bar: Any) -> bool:
    """Restart a dead child; False once it has used up its restarts."""
    log_path = launch.run_dir / "logs" / f"{dead.name}.log"
    bar.write(f"{dead.name} exited with code {dead.proc.returncode}; see {log_path}")
    if dead.restarts >= launch.max_restarts:
        launch.failure = f"{dead.name} failed {dead.restarts + 1} times" + last_words(log_path)
        bar.write(f"{dead.name} failed {dead.restarts + 1} times; stopping the run")
        return False
    launch.restart(dead)
    bar.write(f"restarted {dead.name} ({dead.restarts}/{launch.max_restarts})")
    return True


def last_words(log_path: Path) -> str:
    """`: <the last line of a log>` (how a service that exits says why), or nothing."""
    try:
        lines = log_path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return f": {lines[-1].strip()}" if lines else ""


def update_bar(
    bar: Any, client: Any, keys: RunKeys, run: str, history: list[dict[str, int]], need: int = 0
) -> None:
    """Advance the bar to the learner's last step, show its numbers, record the ledger."""
    m = last_metrics(client, keys)
    if m is None or m["step"] <= bar.n:
        return
    bar.update(m["step"] - bar.n)
    ledger = read_ledger(client, run)
    history.append({"step": m["step"], "kept": ledger.kept, "filtered": ledger.filtered_total})
    kept = ledger.kept / max(ledger.kept + ledger.filtered_total, 1)
    last_eval = client.xrevrange(keys.evals, count=1)
    held_out = eval_postfix(json.loads(last_eval[0][1][b"json"])) if last_eval else {}
    rejected = {"rejected": str(ledger.rejected_total)} if ledger.rejected_total else {}
    bar.set_postfix(
        reward=f"{m['reward_mean']:.2f}",
        acc=f"{m['accuracy']:.2f}",
        kept=f"{kept:.2f}",
        tok_s=f"{m['tokens'] / max(m['seconds'], 1e-9):.0f}",
        v=m["step"],
        **held_out,
        **sampling_postfix(recent_metrics(client, keys), need),
        **rejected,
    )


def sampling_postfix(recent: list[dict[str, Any]], need: int) -> dict[str, str]:
    """Dynamic sampling's cost on the bar, from the last steps' metrics (newest first):
    groups generated (decided by the buffer) per group trained over them, and the last
    step's batch when the generation budget cut it short: `gen/tr=3.1`, `batch=5/16`.
    Over several steps: one step's count swings with the `train` backlog it started from."""
    known = [m for m in recent if "groups" in m]
    if not known:
        return {}
    generated, trained = sum(m["generated"] for m in known), sum(m["groups"] for m in known)
    out = {"gen/tr": f"{generated / max(trained, 1):.1f}"}
    if known[0]["groups"] < need:
        out["batch"] = f"{known[0]['groups']}/{need}"
    return out


def recent_metrics(client: Any, keys: RunKeys, count: int = 10) -> list[dict[str, Any]]:
    """The learner's last `count` step records, newest first."""
    return [json.loads(f[b"json"]) for _, f in client.xrevrange(keys.metrics, count=count)]


def eval_postfix(point: dict[str, Any]) -> dict[str, str]:
    """The progress bar's last held-out accuracy: `eval=0.81@v40` (avg@n at version 40)."""
    accuracy = point[f"avg@{point['n']}"]
    return {"eval": f"{accuracy:.2f}@v{point['version']}"}


def scored_timings(client: Any, keys: RunKeys) -> list[dict[str, Any]]:
    """Each scored group's id, admission and scoring times, and the controller's timing.

    Read from the `scored` stream, whose acked entries the buffer trims beyond the newest
    `buffer.stream_retain`: a long run's accounting covers its last groups only.
    """
    out = []
    for _, fields in client.xrange(keys.scored):
        if b"timing" not in fields:
            continue
        group = decode_group(fields[b"group"])
        out.append(
            {
                "group_id": group.group_id,
                "admitted_at": group.admitted_at,
                "scored_at": group.scored_at,
                **json.loads(fields[b"timing"]),
            }
        )
    return out


def write_report(launch: Launch, started: float, code: int) -> Path:
    config = launch.config
    client = connect_run(config)
    keys = RunKeys(config.shared.run_name)
    # A stream id starts with its Redis server time in ms: when the step was committed.
    steps = [
        dict(json.loads(f[b"json"]), committed_at=int(eid.split(b"-")[0]) / 1000)
        for eid, f in client.xrange(keys.metrics)
    ]
    ledger = read_ledger(client, config.shared.run_name)
    traces = [json.loads(f[b"json"]) for _, f in client.xrange(keys.steps)]
    segment = launch.segment
    segments = segment.record.segments if segment else []
    wall = round(time.monotonic() - started, 2)
    report = {
        "run": config.shared.run_name,
        "run_id": segment.run_id if segment else None,
        "exit_code": code,
        # The whole run's: every segment's (this one's last entry is not yet recorded).
        "wall_seconds": round(sum(s.get("wall_s", 0.0) for s in segments[:-1]) + wall, 2),
        "segments": [*segments[:-1], {**(segments[-1] if segments else {}), "wall_s": wall}],
        "steps": steps,
        "kept_history": launch.history,
        "ledger": ledger.as_dict(),
        "time_accounting": time_accounting(scored_timings(client, keys), traces, steps),
        "eval_curve": eval_curve(client, keys),
        "cpu_per_step": launch.cpu.per_step(),
        "checkpoint_step": latest_checkpoint_step(config),
        "dynamic_sampling": sampling_summary(
            steps,
            ledger.as_dict(),
            config.shared.train_batch_groups,
            config.learner.generation_budget,
        ),
        **launch.evals,
    }
    if steps:
        try:
            plots = launch.run_dir / "plots"
            write_plots(steps, kept_ratios(launch.history), plots, report["eval_curve"])
        except ImportError:
            print("matplotlib is not installed: no plots (pip install 'dapo[plots]')")
    for line in summary_lines(report):
        print(line)
    return save_report(report, launch.run_dir)


def launch(
    config: DapoConfig,
    run_dir: str | None = None,
    steps: int | None = None,
    rollouts: int = 1,
    on_step: Callable[[Launch, int, bool], None] | None = None,
    watch: StallWatch | None = None,
    mode: Mode = "new",
) -> int:
    """Run the whole system until the learner's last step; clean up whatever happens.

    The training data is checked first (a DapoError before any process starts); `watch`
    says when a stall is shown and whether it stops the run (default: shown after 30 s);
    `mode` starts a new run, resumes the directory's run, or moves it aside (resume.py).
    """
    if steps is not None:
        config.learner.total_steps = steps
    out = Path(run_dir or Path("runs") / config.shared.run_name)
    lock = RunLock(out).acquire()
    try:
        return run_locked(config, out, rollouts, on_step, watch, mode)
    finally:
        lock.release()


def run_locked(
    config: DapoConfig,
    out: Path,
    rollouts: int,
    on_step: Callable[[Launch, int, bool], None] | None,
    watch: StallWatch | None = None,
    mode: Mode = "new",
) -> int:
    """`launch` once it holds the run directory."""
    segment = begin(config, out, mode)
    ensure_model(config)
    checks.report(checks.check_run(config, checks.local_gpus(config)), "up")
    checks.report_data(config, "up")
    started = time.monotonic()
    state = Launch(config, out, on_step=on_step, segment=segment)
    state.watch = watch or StallWatch(STALL_AFTER_S, token=config.security.auth.secret())
    code = 1
    previous = stop_on_signals(state)
    try:
        code = run_segment(state, rollouts)
    except KeyboardInterrupt:
        print("interrupted; stopping every service (again: at once)", file=sys.stderr)
        code = 128 + (state.signum or signal.SIGINT)
    finally:
        hurry_on_signals(state)
        report = finish(state, started, code)
        for s, handler in previous.items():
            signal.signal(s, handler)
    if report is not None:
        print(f"report: {report}")
    if state.failure is not None:
        print(f"dapo up: error: {state.failure}", file=sys.stderr)
    return code


def run_segment(state: Launch, rollouts: int) -> int:
    """Start Redis and the services, train to the end, evaluate; the exit code.

    The held-out evaluation of the initial model runs after training, not before: it
    reads the unchanged model directory with the same seed, so its numbers are the same,
    and the services start (and the first step comes) seconds sooner. The final model
    is evaluated first, while the learner lingers to hand over its weights."""
    config, segment = state.config, state.segment
    assert segment is not None
    prepare(config, state.run_dir, state, keep_redis=segment.resumed)
    claim_redis(state.config, segment)
    state.claimed = True
    record_segment(state.run_dir, segment, total_steps=config.learner.total_steps)
    plan = eval_plan(config)  # reads the held-out data now: a bad file fails before training
    previous = previous_report(state.run_dir) if segment.resumed else {}
    if "eval_before" in previous:
        state.evals["eval_before"] = previous["eval_before"]
    state.history = [h for h in previous.get("kept_history", []) if h["step"] <= segment.start_step]
    state.start_all(rollouts)
    code = monitor(state)
    if plan is not None and code == 0:
        state.evals["eval_after"] = run_eval_plan(plan, state.config, fetch_final=True)
        if "eval_before" not in state.evals:
            state.evals["eval_before"] = run_eval_plan(plan, state.config, fetch_final=False)
    return code


def previous_report(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "report.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def finish(state: Launch, started: float, code: int) -> Path | None:
    """Services first (the learner checkpoints on SIGTERM, and the report must hold every
    step it committed), then the report (unless hurried), Redis last; the report's path."""
    report = None
    state.stop_children()
    if state.claimed and state.segment is not None:
        record_segment(
            state.run_dir,
            state.segment,
            end_step=latest_checkpoint_step(state.config) or 0,
            exit_code=code,
            wall_s=round(time.monotonic() - started, 2),
        )
    if state.claimed and not state.hurry:
        try:
            report = write_report(state, started, code)
        except Exception as exc:  # reporting must never block the clean-up
            print(f"could not write the report: {exc}", file=sys.stderr)
    state.stop_redis()
    return report
