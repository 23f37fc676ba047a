"""One simulated-cluster run: the real services in this process, the stand-ins inside.

Redis is a real redis-server; controller, buffer, reward (with its worker process) and
the rollout and learner servers are the real servers on free ports, talking gRPC and
Redis Streams as in a deployment. Only the engine and the trainer are stand-ins
(benchmarks/_sim_standins.py). A sampler thread reads the stand-ins' counters so the
measured window can leave out the warm-up steps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import redis

from benchmarks._sim_standins import SimCosts, SimEngine, SimTrainer
from rollout.config import VllmEngineConfig
from services.common.adapters import decode_group
from services.common.keys import RunKeys
from services.common.ledger import read_ledger

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mode:
    """`staleness` paces admission; `hard` (None: the project's default, 4 x staleness)
    is the bound past which groups are dropped; below it stale groups are corrected."""

    name: str
    staleness: int
    partial: bool
    hard: int | None = None


@dataclass(frozen=True)
class Shape:
    """The run's size: L_max, group size G, groups per step N, steps (and warm-up)."""

    l_max: int = 512
    group_size: int = 8
    batch_groups: int = 8
    steps: int = 30
    warmup: int = 8  # the informative-rate estimate settles (admission over-admits before)


def sim_config(mode: Mode, model: Path, redis_url: str, shape: Shape) -> Any:
    from services.tools.config import load_config

    ports = [
        f"{role}.server.{kind}_port=0"
        for role in ("rollout", "reward", "learner")
        for kind in ("grpc", "http")
    ] + ["controller.server.http_port=0", "buffer.server.http_port=0"]
    config = load_config(
        preset="tiny",
        env={},
        overrides=[
            f"shared.run_name=sim-{mode.name}",
            f"shared.model_path={model}",
            f"shared.redis_url={redis_url}",
            f"shared.max_staleness={mode.staleness}",
            f"shared.max_response_length={shape.l_max}",
            f"shared.group_size={shape.group_size}",
            f"shared.train_batch_groups={shape.batch_groups}",
            f"rollout.partial_rollouts={str(mode.partial).lower()}",
            "rollout.weight_poll_s=0.01",
            f"learner.total_steps={shape.steps}",
            "learner.linger_s=0",
            "controller.eval.enabled=false",
            *ports,
            *([] if mode.hard is None else [f"shared.max_staleness_hard={mode.hard}"]),
        ],
    )
    config.rollout.engine = VllmEngineConfig()  # what SimEngine stands for: its limits
    return config


class Sampler:
    """(wall time, slot-seconds decoded, tokens decoded) every `period_s`."""

    def __init__(self, engine: SimEngine, period_s: float = 0.01) -> None:
        self.engine, self.period_s = engine, period_s
        self.samples: list[tuple[float, float, int]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(self.period_s):
            self.samples.append((time.time(), self.engine.row_seconds, self.engine.tokens))

    def at(self, t: float) -> tuple[float, int]:
        """The counters at the last sample not after `t`."""
        before = [s for s in self.samples if s[0] <= t] or self.samples[:1]
        return before[-1][1], before[-1][2]


def start_services(config: Any, client: redis.Redis, engine: SimEngine, trainer: SimTrainer):
    """Learner first (it publishes version 0), then reward, rollout, buffer, controller."""
    from learner.server import LearnerServer
    from reward.server import create_server as reward_server
    from rollout.server import RolloutServer
    from services.buffer.server import create_server as buffer_server
    from services.controller.server import create_server as controller_server

    learner = LearnerServer(config, client, trainer).start()
    reward = reward_server(config).start()
    rollout = RolloutServer(config, client, engine).start()
    loops = [buffer_server(config, client).start(), controller_server(config, client).start()]
    return learner, reward, rollout, loops


def run_mode(
    mode: Mode, model: Path, redis_url: str, shape: Shape, costs: SimCosts, deadline_s: float = 180
) -> dict:
    """Train `shape.steps` steps in `mode`; the measurements of the window after warm-up."""
    from transformers import AutoTokenizer

    config = sim_config(mode, model, redis_url, shape)
    client = redis.Redis.from_url(redis_url)
    tokenizer = AutoTokenizer.from_pretrained(model)
    engine = SimEngine(tokenizer, costs, config.partial_rollouts(), config.rollout.engine)
    trainer = SimTrainer(config, costs)
    learner, reward, rollout, loops = start_services(config, client, engine, trainer)
    stop = threading.Event()
    threads = [threading.Thread(target=s.wait, args=(stop,), daemon=True) for s in loops]
    for t in threads:
        t.start()
    sampler = Sampler(engine)
    watchdog = threading.Timer(deadline_s, stop.set)  # a stuck mode ends, and says so
    watchdog.start()
    try:
        learner.learner.run(stop)
    finally:
        stop.set()
        watchdog.cancel()
        sampler.stop.set()
        for t in threads:
            t.join(timeout=10)
        for service in (*loops, rollout, reward, learner):
            service.stop()
    if learner.learner.step < shape.steps:
        raise RuntimeError(
            f"{mode.name}: {learner.learner.step} of {shape.steps} steps in {deadline_s} s"
        )
    result = measure(mode, client, config.shared.run_name, shape, costs, trainer, sampler)
    return {**result, "staleness_bound": config.shared.staleness_hard_bound}


def measure(
    mode: Mode,
    client: redis.Redis,
    run: str,
    shape: Shape,
    costs: SimCosts,
    trainer: SimTrainer,
    sampler: Sampler,
) -> dict[str, Any]:
    """Throughput, idle shares, staleness and the ledger over steps warmup+1..steps."""
    keys = RunKeys(run)
    records = [
        (int(i.split(b"-")[0]) / 1000, json.loads(f[b"json"]))
        for i, f in client.xrange(keys.metrics)
    ]
    start, end = records[shape.warmup - 1][0], records[-1][0]
    window, measured = end - start, records[shape.warmup :]
    rows0, tokens0 = sampler.at(start)
    rows1, tokens1 = sampler.at(end)
    busy = sum(max(0.0, min(b, end) - max(a, start)) for a, b in trainer.busy)
    ledger = read_ledger(client, run)
    n = len(measured)
    commits = [t for t, _ in records]
    starts = [a for a, _ in trainer.busy]
    ends = [b for _, b in trainer.busy]
    staleness = [int(r["staleness"]) for _, r in records]
    return {
        "mode": asdict(mode),
        "steps_measured": n,
        "window_s": round(window, 3),
        "step_s": window / n,
        "trained_tokens_per_s": sum(r["tokens"] for _, r in measured) / window,
        "t_train_s": sum(r["seconds"] for _, r in measured) / n,
        "generated_tokens_per_step": (tokens1 - tokens0) / n,
        "generation_idle_share": 1 - (rows1 - rows0) / (costs.slots * window),
        "training_idle_share": 1 - busy / window,
        "learner_waits_for_batch_s": mean_gap(
            commits[shape.warmup - 1 : -1], starts[shape.warmup :]
        ),
        "learner_publish_commit_s": mean_gap(ends[shape.warmup :], commits[shape.warmup :]),
        "staleness_max": max(staleness),
        "staleness_mean": sum(staleness) / len(staleness),
        "spanning_samples": spanning(client, keys),
        "ledger": {**asdict(ledger), "problems": ledger.problems(), "ok": not ledger.problems()},
    }


def mean_gap(before: list[float], after: list[float]) -> float:
    """Mean of after[i] - before[i]: e.g. from a commit to the next step's start."""
    return sum(b - a for a, b in zip(before, after, strict=True)) / max(len(after), 1)


def spanning(client: redis.Redis, keys: RunKeys) -> dict[str, int]:
    """Forwarded samples (the `train` stream's retained tail) and how many of them span
    more than one policy version (partial rollouts continued across an update)."""
    groups = [decode_group(f[b"group"]) for _, f in client.xrange(keys.train)]
    samples = [s for g in groups for s in g.samples]
    return {
        "samples": len(samples),
        "spanning_versions": sum(len(set(s.versions())) > 1 for s in samples),
    }


def run_isolated(
    mode: Mode, model: Path, redis_url: str, shape: Shape, costs: SimCosts, timeout_s: float = 300
) -> dict:
    """`run_mode` in a fresh process (arguments and result as JSON): the in-process
    services share one interpreter, whose exit a leftover atexit hook could hold up."""
    args = {
        "mode": asdict(mode),
        "model": str(model),
        "redis_url": redis_url,
        "shape": asdict(shape),
        "costs": asdict(costs),
    }
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks._sim_cluster", json.dumps(args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{mode.name} failed ({out.returncode}): {out.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def _child(raw: str) -> None:
    args = json.loads(raw)
    result = run_mode(
        Mode(**args["mode"]),
        Path(args["model"]),
        args["redis_url"],
        Shape(**args["shape"]),
        SimCosts(**args["costs"]),
    )
    print("RESULT " + json.dumps(result), flush=True)
    sys.stderr.flush()
    os._exit(0)  # every service is stopped; skip the interpreter's exit hooks


if __name__ == "__main__":
    _child(sys.argv[1])
