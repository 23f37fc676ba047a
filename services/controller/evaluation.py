"""The eval curve: held-out accuracy every `controller.eval.every_steps` policy versions,
sampled by the run's own rollout servers (prompts batched into GenerateGroups calls) and
verified by its reward service.

A side channel of the controller, in its own thread: its calls share the training groups'
routing, retries and score batching, but nothing is admitted, so the buffer, the learner
and the ledger never see it. Points go to the run's `evals` stream and the
`dapo_controller_eval_*` gauges. docs/architecture.md, "Held-out evaluation and the eval
curve".
"""

from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import redis
from prometheus_client import Gauge

from services.common.data import PromptRecord
from services.common.eval_hold import Hold
from services.common.eval_stats import curve_point
from services.common.keys import RunKeys
from services.common.settings import SamplingConfig
from services.common.streams import last_id
from services.common.tokenizer import PromptTokenizer
from services.common.types import Sample
from services.controller.clients import groups_per_call
from services.controller.config import ControllerSettings
from services.controller.dataset import dataset_source, eval_data_spec, load_eval_data
from services.controller.episode import Generator, Scorer
from services.controller.failures import Stopped
from services.controller.routing import Router

log = logging.getLogger(__name__)

EVAL_PRIORITY = 1  # a point's calls pass queued training groups (the learner may wait on it)

ACCURACY = Gauge("dapo_controller_eval_accuracy", "Held-out avg@n of the last in-run evaluation")
PASS = Gauge("dapo_controller_eval_pass_at_n", "Held-out pass@n of the last in-run evaluation")
STEP = Gauge("dapo_controller_eval_step", "Policy version (learner step) last evaluated")
LENGTH = Gauge("dapo_controller_eval_response_length", "Mean eval response length, tokens")
TRUNCATION = Gauge("dapo_controller_eval_truncation_rate", "Eval responses cut at the limit")
SECONDS = Gauge("dapo_controller_eval_seconds", "Wall seconds of the last in-run evaluation")


def due(version: int, every: int, last: int | None) -> bool:
    """Whether `version` is to be evaluated: the first time, then once `version` has passed
    the next multiple of `every` after the last evaluated one (a skipped multiple, when an
    evaluation took longer than `every` steps, is not made up)."""
    if every <= 0:
        return False
    return last is None or version // every > last // every


def next_due(last: int | None, every: int) -> int:
    """The first version `due` evaluates after `last` (0: the first point)."""
    return 0 if last is None else (last // every + 1) * every


class Controller(Protocol):
    """What an evaluation uses of the controller (services/controller/server.py): the
    same typed clients as the training groups."""

    config: ControllerSettings
    client: redis.Redis
    keys: RunKeys
    router: Router
    tokenizer: PromptTokenizer
    records: list[PromptRecord]

    @property
    def rollouts(self) -> Generator: ...

    @property
    def rewards(self) -> Scorer: ...

    def version(self) -> int: ...


class Evaluator:
    """Evaluates the held-out records on the run's rollout servers as versions go by."""

    def __init__(self, controller: Controller, records: list[PromptRecord]) -> None:
        self.controller, self.records = controller, records
        self.cfg = controller.config.controller.eval
        self.client, self.keys = controller.client, controller.keys
        # one pool for the run: threads started per point cost ~1 ms of its GIL time
        self.pool = ThreadPoolExecutor(self.cfg.concurrency, "eval")

    def last_version(self) -> int | None:
        """The version of the run's last eval point (a restarted controller goes on)."""
        entries = self.client.xrevrange(self.keys.evals, count=1)
        return json.loads(entries[0][1][b"json"])["version"] if entries else None

    def learner_step(self) -> int:
        entries = self.client.xrevrange(self.keys.metrics, count=1)
        return int(json.loads(entries[0][1][b"json"])["step"]) if entries else 0

    def run(self, stop: threading.Event) -> None:
        try:
            self._run(stop)
        finally:
            self.pool.shutdown(wait=False, cancel_futures=True)

    def _run(self, stop: threading.Event) -> None:
        last = self.last_version()
        self.ask_hold(last)
        seen = last_id(self.client, self.keys.metrics)
        while not stop.is_set():
            seen = self.wait_for_commit(seen)
            version = self.controller.version()
            if not due(version, self.cfg.every_steps, last) or not self.serving():
                continue
            try:
                point = self.evaluate(version, stop)
            except Exception:  # an evaluation never takes the controller down
                log.exception("evaluation at version %d failed; trying again at the next", version)
                point = None
            last = version
            self.record(point, last)

    def ask_hold(self, last: int | None, pipe: redis.client.Pipeline | None = None) -> None:
        """Name the next version evaluated for the learner to wait at (hold_learner)."""
        if self.cfg.hold_learner:
            hold = Hold(next_due(last, self.cfg.every_steps), self.cfg.hold_max_s)
            (pipe or self.client).set(self.keys.eval_hold, hold.encode())

    def wait_for_commit(self, seen: bytes) -> bytes:
        """Block until the learner commits a step (its metrics entry), at most 0.1 s: a
        point starts as its version is committed, not at the next poll."""
        reply = self.client.xread({self.keys.metrics: seen}, count=64, block=100)
        return reply[0][1][-1][0] if reply else seen

    def serving(self) -> bool:
        """A rollout server accepts work (so a point's seconds are the evaluation's own,
        not the wait for the first server to start)."""
        return any(i.get("accepting") for i in self.controller.router.instances("rollout"))

    def evaluate(self, version: int, stop: threading.Event) -> dict[str, Any] | None:
        """One eval point at (at least) `version`; None when stopping cut it short."""
        started, step = time.monotonic(), self.learner_step()
        shared = self.controller.config.shared
        size = groups_per_call(
            self.cfg.groups_per_call,
            self.cfg.n,
            shared.max_response_length,
            shared.rpc.max_message_bytes,
        )
        chunks = [self.records[i : i + size] for i in range(0, len(self.records), size)]
        answers = list(self.pool.map(lambda chunk: self.sample(chunk, version, stop), chunks))
        if any(a is None for a in answers) or stop.is_set():
            return None
        rows: list[list[Sample]] = [row for answer in answers if answer for row in answer]
        versions = [s.policy_version for row in rows for s in row]
        return {
            "version": version,
            "step": step,
            "n": self.cfg.n,
            **curve_point(
                [[s.correct for s in row] for row in rows],
                [[len(s.token_ids) for s in row] for row in rows],
                [[s.truncated for s in row] for row in rows],
                self.cfg.n,
            ),
            "sample_versions": [min(versions), max(versions)],
            "seconds": round(time.monotonic() - started, 3),
            "at": time.time(),
        }

    def sample(
        self, records: list[PromptRecord], version: int, stop: threading.Event
    ) -> list[list[Sample]] | None:
        """n scored responses to each held-out prompt, in one GenerateGroups call and
        shared Score calls (None when stopping; raises when a group failed for good)."""
        cfg, c = self.cfg, self.controller
        asks = [(f"eval-v{version}-{r.prompt_id}", r) for r in records]
        sampling = SamplingConfig(temperature=cfg.temperature, top_p=cfg.top_p)
        try:
            generated = c.rollouts.generate_many(
                asks, cfg.n, sampling, version, stop, priority=EVAL_PRIORITY
            )
            scored = c.rewards.score_many(
                [
                    (eval_id, g.samples, r.ground_truth)
                    for (eval_id, r), g in zip(asks, generated, strict=True)
                ],
                stop,
            )
        except Stopped:
            return None
        rows = []
        for row in scored:
            if isinstance(row, BaseException):
                raise row
            rows.append(row)
        return rows

    def record(self, point: dict[str, Any] | None, last: int) -> None:
        """Write the point (None: it failed) and, in the same transaction, release a
        waiting learner by naming the next version to hold at."""
        pipe = self.client.pipeline()
        if point is not None:
            pipe.xadd(self.keys.evals, {"json": json.dumps(point)})
        self.ask_hold(last, pipe)
        pipe.execute()
        if point is not None:
            self.observe(point)

    def observe(self, point: dict[str, Any]) -> None:
        n = point["n"]
        ACCURACY.set(point[f"avg@{n}"])
        PASS.set(point[f"pass@{n}"])
        STEP.set(point["version"])
        LENGTH.set(point["response_length"])
        TRUNCATION.set(point["truncation_rate"])
        SECONDS.set(point["seconds"])
        log.info(
            "eval v%d (step %d): avg@%d %.3f pass@%d %.3f length %.1f truncated %.3f %.1fs",
            point["version"],
            point["step"],
            n,
            point[f"avg@{n}"],
            n,
            point[f"pass@{n}"],
            point["response_length"],
            point["truncation_rate"],
            point["seconds"],
        )


def start_evaluation(controller: Controller, stop: threading.Event) -> threading.Thread | None:
    """The eval-curve thread, when `controller.eval` asks for one and names held-out data."""
    cfg = controller.config.controller
    controller.client.delete(controller.keys.eval_hold)  # a hold of an earlier setting
    spec = eval_data_spec(cfg.eval, cfg.dataset)
    if not cfg.eval.enabled or cfg.eval.every_steps == 0 or spec is None:
        return None
    records = screened_eval_records(controller, spec)
    if not records:
        return None
    thread = threading.Thread(
        target=Evaluator(controller, records).run, args=(stop,), name="eval", daemon=True
    )
    thread.start()
    return thread


def screened_eval_records(controller: Controller, spec: str) -> list[PromptRecord]:
    """The held-out records, less those a rollout server would refuse (empty, too long):
    a refused prompt would fail every eval point. What is skipped is logged."""
    cfg, shared = controller.config.controller, controller.config.shared
    training = (controller.records, dataset_source(cfg.dataset))
    data = load_eval_data(
        spec, cfg.eval.limit, controller.tokenizer, shared.max_prompt_length, training
    )
    if data.filtered:
        log.warning("eval %s", data.describe())
    for warning in data.warnings:
        log.warning("eval data: %s", warning)
    if not data.records:
        log.error("no eval curve: every held-out prompt was skipped")
    return data.records
