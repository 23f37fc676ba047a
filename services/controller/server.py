"""The controller: admits prompts, gets G samples from a rollout server, scores them, and
writes the ScoredGroup to the `scored` stream.

Nothing is lost: a group is recorded in the `inflight` hash (with the ledger's
`admitted` counter and the cursor, in one transaction) before any work starts, and leaves
it in the same transaction that appends it to `scored`. A restarted controller re-runs
whatever is still in flight. Group ids come from the cursor, so they are deterministic.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter as Tally
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from typing import Any

import grpc
import redis
from prometheus_client import Counter, Gauge, Histogram

from dapo.v1 import reward_pb2_grpc, rollout_pb2_grpc
from services.common.adapters import encode_group
from services.common.atomic import admit_inflight, publish_inflight, reject_inflight
from services.common.data import PromptRecord
from services.common.data_screen import EMPTY, TOO_LONG
from services.common.error_log import ErrorLog
from services.common.errors import DapoError
from services.common.grpc_server import channel
from services.common.keys import RunKeys
from services.common.ledger import read_ledger
from services.common.redis_server import connect_run
from services.common.retry import Backoff, RetriesExhausted, call_with_retry
from services.common.service import LoopServer
from services.common.tokenizer import load_tokenizer
from services.common.types import Group
from services.controller import adapter
from services.controller.admission import (
    PipelineCounts,
    RateEstimator,
    backlog_allows,
    pipeline_counts,
    sit_out,
    staleness_allows,
)
from services.controller.config import ControllerSettings
from services.controller.dataset import Cursor, iterate, load_training_data
from services.controller.evaluation import start_evaluation
from services.controller.failures import (
    REFUSALS,
    GroupRejected,
    Rejection,
    RejectionStreak,
    classify,
)
from services.controller.routing import Router
from services.controller.scoring import ScoreBatcher

log = logging.getLogger(__name__)

ADMITTED = Counter("dapo_controller_groups_admitted_total", "Groups admitted")
SCORED = Counter("dapo_controller_groups_scored_total", "Groups written to `scored`")
RETRIES = Counter("dapo_controller_retries_total", "Failed calls retried", ["target"])
INFLIGHT = Gauge("dapo_controller_groups_in_flight", "Groups being generated or scored")
GROUP_SECONDS = Histogram("dapo_controller_group_seconds", "Admission to `scored`, seconds")
SKIPPED = Counter("dapo_controller_prompts_skipped_total", "Prompts skipped", ["difficulty"])
INFORMATIVE_RATE = Gauge("dapo_controller_informative_rate", "Estimated kept fraction")
REJECTED = Counter(
    "dapo_controller_groups_rejected_total", "Groups refused for good, not retried", ["reason"]
)
PROMPTS_FILTERED = Gauge(
    "dapo_controller_prompts_filtered_at_load", "Dataset rows skipped at load", ["reason"]
)
for _reason in (*REFUSALS.values(), "unknown_prompt"):  # at 0 from the start: a panel
    REJECTED.labels(_reason)  # shows 0 rejections, not "No data"


class Controller:
    """Feeds prompts through rollout and reward into the `scored` stream."""

    def __init__(self, config: ControllerSettings, client: redis.Redis) -> None:
        self.config, self.client = config, client
        self.keys = RunKeys(config.shared.run_name)
        shared, cfg = config.shared, config.controller
        self.tokenizer = load_tokenizer(shared.model_path, cfg.apply_chat_template)
        self.data = load_training_data(
            cfg.dataset, shared.seed, self.tokenizer, shared.max_prompt_length, shared.verifier
        )
        self.records = self.data.records
        self.errors = ErrorLog()
        self.streak = RejectionStreak(cfg.max_rejected_in_a_row)
        self.by_id = {r.prompt_id: r for r in self.records}
        self._lock = threading.Lock()
        self._inflight = 0
        self._stubs: dict[str, Any] = {}
        self._rate = RateEstimator()
        self._skips: Tally[str] = Tally()
        self.router = Router(client, self.keys, config.shared.registry_ttl_s)
        self._group_done = threading.Event()  # wakes admission when a slot frees up
        self._calls: set[Any] = set()
        self.scorer = ScoreBatcher(
            self._score_call,
            config.shared.rpc.max_score_items,
            config.shared.rpc.max_message_bytes // 2,
        )

    # ------------------------------------------------------------------ admission
    def version(self) -> int:
        return int(self.client.get(self.keys.version) or 0)

    def counts(self) -> PipelineCounts:
        return pipeline_counts(self.client.hgetall(self.keys.ledger))

    def snapshot(self) -> tuple[PipelineCounts, int, bool]:
        """Ledger counts, policy version and whether the run is done: one round trip."""
        pipe = self.client.pipeline(transaction=False)
        pipe.hgetall(self.keys.ledger)
        pipe.get(self.keys.version)
        pipe.exists(self.keys.done)
        raw, version, done = pipe.execute()
        return pipeline_counts(raw), int(version or 0), bool(done)

    def can_admit(self, counts: PipelineCounts) -> bool:
        """Concurrency, back-pressure and staleness limits (services/controller/admission).

        No rollout lag enters the staleness limit: every group asks its rollout server
        for at least the version current at admission (GenerateRequest.min_version).
        """
        cfg, shared = self.config.controller, self.config.shared
        with self._lock:
            if self._inflight >= cfg.max_groups_in_flight:
                return False
        rate = self._rate.update(counts.kept, counts.filtered)
        INFORMATIVE_RATE.set(rate)
        return backlog_allows(counts, cfg.max_train_backlog) and staleness_allows(
            counts, rate, self.config.shared.train_batch_groups, shared.max_staleness
        )

    def skip_reason(self, record: PromptRecord) -> str | None:
        """Difficulty-aware admission: 'easy'/'hard' prompts sit out epochs (admission.sit_out).

        A prompt is admitted again after the epochs its streak of uniform groups earns
        (1, doubling per further uniform group, at most `difficulty_skip_epochs`).
        """
        cfg = self.config.controller
        if cfg.difficulty_window == 0:
            return None
        raw = self.client.hget(self.keys.pass_rates, record.prompt_id)
        history = json.loads(raw) if raw else []
        reason, epochs = sit_out(history, cfg.difficulty_window, cfg.difficulty_skip_epochs)
        if reason is None or self._skips[record.prompt_id] >= epochs:
            self._skips[record.prompt_id] = 0
            return None
        self._skips[record.prompt_id] += 1
        return reason

    def admit(self, cursor: Cursor, record: PromptRecord, version: int) -> str:
        """Record the group as in flight (atomically with the cursor and the ledger).

        `version` (the policy version at admission) is the least version its samples
        may come from.
        """
        group_id = f"e{cursor.epoch}-{cursor.index - 1}"
        meta = json.dumps({"prompt_id": record.prompt_id, "epoch": cursor.epoch, "v": version})
        k = self.keys
        admit_inflight(self.client, k.inflight, k.cursor, k.ledger, group_id, meta, cursor.encode())
        ADMITTED.inc()
        return group_id

    # ------------------------------------------------------------------ the work
    def _stub(self, address: str, kind: str) -> Any:
        key = f"{kind}@{address}"
        if key not in self._stubs:
            limit = self.config.shared.rpc.max_message_bytes
            chan = channel(address, self.config.security, limit)
            factory = (
                rollout_pb2_grpc.RolloutServiceStub
                if kind == "rollout"
                else reward_pb2_grpc.RewardServiceStub
            )
            self._stubs[key] = factory(chan)
        return self._stubs[key]

    def generate(
        self,
        group_id: str,
        record: PromptRecord,
        version: int,
        stop: threading.Event,
        request: Any = None,
    ) -> Any:
        """G samples (or `request`'s n: an evaluation's) from some ready rollout server; a
        failed call is re-routed after a backoff.

        GenerateGroup writes nothing, so repeating it is safe; None when stopping (the group
        stays in flight and the next controller re-runs it).
        """
        shared, cfg = self.config.shared, self.config.controller
        if request is None:
            request = adapter.generate_request(
                group_id,
                record,
                shared.group_size,
                self.config.shared.sampling,
                shared.max_response_length,
                self.tokenizer.fingerprint,
                min_version=version,
            )

        def attempt() -> Any:
            with self.router.rollout() as address:
                if address is None:
                    raise ConnectionError("no ready rollout server")
                try:
                    stub = self._stub(address, "rollout")
                    call = stub.GenerateGroup.future(request, timeout=cfg.rpc_timeout_s)
                    with self._tracked(call):
                        return adapter.samples_from_group(call.result(), request.n)
                except grpc.RpcError as exc:
                    if exc.code() == grpc.StatusCode.UNAVAILABLE:
                        self.router.shun(address)
                    raise

        return self._retry(attempt, "rollout", group_id, stop)

    def score(self, group_id: str, record: PromptRecord, samples: list, stop: threading.Event):
        """Rewards from the reward service (a pure function of the request: safe to retry)."""
        verifier = self.config.shared.verifier
        request = adapter.score_request(samples, record.ground_truth, verifier, group_id)

        def attempt() -> list:
            adapter.apply_scores(samples, self.scorer.score(request))
            return samples

        return self._retry(attempt, "reward", group_id, stop)

    def _retry(self, attempt: Any, target: str, group_id: str, stop: threading.Event) -> Any:
        """attempt() with backoff while it fails transiently, until it succeeds or we stop
        (then None); a permanent failure raises GroupRejected at once (failures.py)."""
        rpc = self.config.shared.rpc

        def on_retry(exc: BaseException, delay: float) -> None:
            if stop.is_set():  # a call cancelled by stopping: no failure, no retry
                return
            RETRIES.labels(target).inc()
            text = error_text(exc)
            self.errors.record(f"{target} {error_class(exc)}", text)
            if not isinstance(exc, ConnectionError):
                log.warning(
                    "%s for %s failed, retrying in %.2fs: %s", target, group_id, delay, text
                )

        try:
            return call_with_retry(
                attempt,
                Backoff(rpc.backoff_base_s, rpc.backoff_cap_s),
                retryable=lambda e: classify(e, target) is None,
                stop=stop,
                on_retry=on_retry,
            )
        except RetriesExhausted:
            return None
        except Exception as exc:
            rejection = classify(exc, target)
            if rejection is None:
                raise
            raise GroupRejected(rejection) from exc

    @contextmanager
    def _tracked(self, call: Any) -> Iterator[None]:
        """Remember a running call so that stopping can cancel it (graceful shutdown)."""
        with self._lock:
            self._calls.add(call)
        try:
            yield
        finally:
            with self._lock:
                self._calls.discard(call)

    def cancel_calls(self) -> int:
        """Cancel every running GenerateGroup/Score call; their groups stay in flight (handed
        back)."""
        with self._lock:
            calls = list(self._calls)
        for call in calls:
            call.cancel()
        return len(calls)

    def _score_call(self, request: Any) -> Any:
        """One (merged) Score call on the registered reward service; stopping cancels it."""
        rewards = self.router.instances("reward")
        if not rewards:
            raise ConnectionError("no reward service registered")
        stub = self._stub(rewards[0]["address"], "reward")
        call = stub.Score.future(request, timeout=self.config.shared.rpc.score_timeout_s)
        with self._tracked(call):
            return call.result()

    def process(
        self, group_id: str, record: PromptRecord, epoch: int, version: int, stop: threading.Event
    ) -> None:
        started = time.monotonic()
        try:
            with self._generating(group_id):
                generated = self.generate(group_id, record, version, stop)
            if generated is None:
                return  # stopping: the group stays in flight for the next start
            prompt_ids, samples = generated
            generated_s = time.monotonic() - started
            if self.score(group_id, record, samples, stop) is None:
                return
            timing = {
                "generate_s": generated_s,
                "score_s": time.monotonic() - started - generated_s,
            }
            group = Group(
                group_id=group_id,
                prompt_id=record.prompt_id,
                prompt=record.prompt,
                prompt_token_ids=prompt_ids,
                ground_truth=record.ground_truth,
                samples=samples,
                run_id=self.config.shared.run_name,
                epoch=epoch,
                admitted_version=version,
                admitted_at=time.time() - (time.monotonic() - started),
                scored_at=time.time(),
                data_source=record.data_source,
            )
            self.publish(group, timing)
            self.streak.success()
            GROUP_SECONDS.observe(time.monotonic() - started)
        except GroupRejected as exc:
            self.reject(group_id, record, exc.rejection)
        except Exception:
            log.exception("group %s failed; it stays in flight and is retried on restart", group_id)
        finally:
            with self._lock:
                self._inflight -= 1
                INFLIGHT.set(self._inflight)
            self._group_done.set()

    @contextmanager
    def _generating(self, group_id: str) -> Iterator[None]:
        """An entry in the `generating` stream while the group waits for or is in
        generation (KEDA's backlog); best effort: a Redis blip never fails the group."""
        entry = None
        with suppress(redis.RedisError):
            entry = self.client.xadd(self.keys.generating, {"group_id": group_id})
        try:
            yield
        finally:
            if entry is not None:
                with suppress(redis.RedisError):
                    self.client.xdel(self.keys.generating, entry)

    def publish(self, group: Group, timing: dict[str, float] | None = None) -> None:
        """Leave `inflight` and append to `scored`, atomically and once per group id.

        `timing` (seconds in the GenerateGroup and Score calls) rides beside the group as a
        plain stream field, for the run report's time accounting (`services/tools/report.py`).
        """
        fields: dict[str, bytes | str] = {
            "group": encode_group(group),
            "group_id": group.group_id,
        }
        if timing is not None:
            fields["timing"] = json.dumps(timing)
        k = self.keys
        if publish_inflight(self.client, k.inflight, k.scored, k.ledger, group.group_id, fields):
            SCORED.inc()

    def reject(self, group_id: str, record: PromptRecord, rejection: Rejection) -> None:
        """Leave `inflight` for the `rejected` stream with the reason (once per group id)."""
        fields = {"prompt_id": record.prompt_id, "detail": rejection.detail}
        if reject_inflight(self.client, self.keys, group_id, rejection.reason, fields):
            REJECTED.labels(rejection.reason).inc()
        self.errors.record(f"rejected {rejection.reason}", rejection.detail)
        self.streak.rejected(rejection)
        exc_text = f"{rejection.reason}: {rejection.detail}"
        log.warning("group %s (prompt %s) rejected: %s", group_id, record.prompt_id, exc_text)

    def reject_unknown(self, group_id: str, prompt_id: str) -> None:
        """A resumed group whose prompt is not in the data as loaded now."""
        fields = {"prompt_id": prompt_id, "detail": "its prompt is not in the data as loaded"}
        if reject_inflight(self.client, self.keys, group_id, "unknown_prompt", fields):
            REJECTED.labels("unknown_prompt").inc()
        log.error("in-flight group %s: prompt %s is not in the data; rejected", group_id, prompt_id)

    def publish_dataset(self) -> None:
        """The data as loaded into the run's `dataset` hash (the ledger's prompt accounting)."""
        log.info("%s", self.data.describe())
        for warning in self.data.warnings:
            log.warning("data: %s", warning)
        for reason in {EMPTY, TOO_LONG, *self.data.filtered}:  # 0s too: not "No data"
            PROMPTS_FILTERED.labels(reason).set(self.data.filtered.get(reason, 0))
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(self.keys.dataset)
        pipe.hset(self.keys.dataset, mapping=self.data.counts())
        pipe.execute()

    def give_up(self, reason: str) -> None:
        """The run cannot make progress: say why in `failed` (`dapo up` stops the run)."""
        self.client.set(self.keys.failed, reason)
        raise DapoError(reason)

    # ------------------------------------------------------------------ main loop
    def _submit(
        self,
        pool: ThreadPoolExecutor,
        stop: threading.Event,
        group_id: str,
        record: PromptRecord,
        epoch: int,
        version: int,
    ) -> None:
        with self._lock:
            self._inflight += 1
            INFLIGHT.set(self._inflight)
        pool.submit(self.process, group_id, record, epoch, version, stop)

    def resume_inflight(self, pool: ThreadPoolExecutor, stop: threading.Event) -> int:
        """Re-run groups a previous controller admitted but never published."""
        pending = self.client.hgetall(self.keys.inflight)
        for raw_id, raw_meta in pending.items():
            meta = json.loads(raw_meta)
            record = self.by_id.get(meta["prompt_id"])
            if record is None:  # the data changed, or now skips it at load: account for it
                self.reject_unknown(raw_id.decode(), meta["prompt_id"])
                continue
            self._submit(pool, stop, raw_id.decode(), record, meta["epoch"], meta["v"])
        return len(pending)

    def run(self, stop: threading.Event) -> None:
        cfg, shared = self.config.controller, self.config.shared
        start = Cursor.decode(self.client.get(self.keys.cursor))
        prompts = iterate(self.records, start, shared.seed, cfg.dataset.shuffle)
        self.client.delete(self.keys.generating)  # a previous controller's entries
        self.publish_dataset()
        evaluation = start_evaluation(self, stop)  # the eval curve (None when off)
        with ThreadPoolExecutor(cfg.max_groups_in_flight + 1, "group") as pool:
            resumed = self.resume_inflight(pool, stop)
            log.info("controller starts at %s with %d groups resumed", start.encode(), resumed)
            while not stop.is_set():
                counts, version, done = self.snapshot()
                if done:
                    break
                if (hopeless := self.streak.verdict()) is not None:
                    stop.set()
                    self.cancel_calls()
                    self.give_up(hopeless)
                if not self.can_admit(counts):
                    self._group_done.wait(0.01)  # or a learner step / buffer decision
                    self._group_done.clear()
                    continue
                cursor, record = next(prompts)
                reason = self.skip_reason(record)
                if reason is not None:
                    SKIPPED.labels(reason).inc()
                    self.client.set(self.keys.cursor, cursor.encode())
                    continue
                group_id = self.admit(cursor, record, version)
                self._submit(pool, stop, group_id, record, cursor.epoch, version)
            stop.set()
            cancelled = self.cancel_calls()  # hand unfinished groups back: they stay in flight
            log.info("stopping: %d calls cancelled, their groups stay in flight", cancelled)
        if evaluation is not None:
            evaluation.join(timeout=10)
        self.scorer.close()

    def status(self) -> dict[str, Any]:
        with self._lock:
            inflight = self._inflight
        ledger = read_ledger(self.client, self.config.shared.run_name)
        return {
            "in_flight": inflight,
            "cursor": Cursor.decode(self.client.get(self.keys.cursor)).encode(),
            "version": self.version(),
            "prompts": len(self.records),
            "ledger": ledger.as_dict(),
            "last_error": self.errors.snapshot(),
        }


def error_class(exc: BaseException) -> str:
    """A failure's class in a word: the gRPC status code, else the exception type."""
    if isinstance(exc, grpc.RpcError) and isinstance(exc, grpc.Call):
        return exc.code().name
    return type(exc).__name__


def error_text(exc: BaseException) -> str:
    """`CODE: details` of a gRPC error (its str() is a multi-line dump), else str()."""
    if isinstance(exc, grpc.RpcError) and isinstance(exc, grpc.Call):
        return f"{exc.code().name}: {exc.details()}"
    return str(exc)


def create_server(config: ControllerSettings, client: redis.Redis | None = None) -> LoopServer:
    """The controller and its HTTP endpoints (start() serves them, wait() runs the loop)."""
    controller = Controller(config, client or connect_run(config))
    return LoopServer("controller", controller, config.controller.server, config.security.auth)
