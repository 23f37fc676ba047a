"""The controller: admits prompts and hands each admitted group to an Episode (generate →
score → publish to `scored`); this module is the loop that wires the parts together.

Nothing is lost: a group is recorded in the `inflight` hash (with the ledger's
`admitted` counter and the cursor, in one transaction) before any work starts, and leaves
it in the same transaction that appends it to `scored` or, with a reason, to `rejected`.
A restarted controller re-runs whatever is still in flight. Group ids come from the
cursor, so they are deterministic. The parts: admission.py (what may start), clients.py
(rollout and reward), episode.py (one group), run_state.py (Redis).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import redis
from prometheus_client import Counter, Gauge, Histogram

from services.common.data import PromptRecord
from services.common.data_screen import EMPTY, TOO_LONG
from services.common.error_log import ErrorLog
from services.common.errors import DapoError
from services.common.keys import RunKeys
from services.common.ledger import read_ledger
from services.common.redis_server import connect_run
from services.common.service import LoopServer
from services.common.tokenizer import load_tokenizer
from services.controller.admission import Admission, Limits, history_length
from services.controller.clients import (
    RETRIES,
    Calls,
    Retrier,
    RewardClient,
    RolloutClient,
    RolloutSettings,
    groups_per_call,
)
from services.controller.config import ControllerSettings
from services.controller.dataset import Cursor, iterate, load_training_data
from services.controller.episode import Episode, EpisodeSettings, Outcome, Ticket
from services.controller.evaluation import start_evaluation
from services.controller.failures import CONTROLLER_ERROR, REFUSALS, Rejection, RejectionStreak
from services.controller.routing import Router
from services.controller.run_state import REJECTED, SCORED, RunState

__all__ = ["REJECTED", "RETRIES", "SCORED", "Controller", "create_server"]

log = logging.getLogger(__name__)

ADMITTED = Counter("dapo_controller_groups_admitted_total", "Groups admitted")
INFLIGHT = Gauge("dapo_controller_groups_in_flight", "Groups being generated or scored")
GROUP_SECONDS = Histogram("dapo_controller_group_seconds", "Admission to `scored`, seconds")
SKIPPED = Counter("dapo_controller_prompts_skipped_total", "Prompts skipped", ["difficulty"])
INFORMATIVE_RATE = Gauge("dapo_controller_informative_rate", "Estimated kept fraction")
PROMPTS_FILTERED = Gauge(
    "dapo_controller_prompts_filtered_at_load", "Dataset rows skipped at load", ["reason"]
)
for _reason in (*REFUSALS.values(), "unknown_prompt", CONTROLLER_ERROR):  # at 0 from the
    REJECTED.labels(_reason)  # start: a panel shows 0 rejections, not "No data"

WAKE_S = 1.0  # the longest admission sleeps without a notification (a lost one, `done`)
WATCH_S = 1.0  # one blocking read of the ledger changes (stopping waits at most this)


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
        self.by_id = {r.prompt_id: r for r in self.records}
        self.errors = ErrorLog()
        self.state = RunState(
            client, self.keys, history_length(cfg.difficulty_window, cfg.difficulty_skip_epochs)
        )
        self.admission = Admission(limits(config), self.state, self.state)
        self.router = Router(client, self.keys, shared.registry_ttl_s)
        self.calls = Calls(config.security, shared.rpc.max_message_bytes)
        retrier = Retrier(shared.rpc, self.errors)
        self.rollouts = RolloutClient(
            self.router,
            self.calls,
            retrier,
            RolloutSettings(
                shared.max_response_length, self.tokenizer.fingerprint, cfg.rpc_timeout_s
            ),
        )
        self.rewards = RewardClient(self.router, self.calls, retrier, shared.verifier, shared.rpc)
        self.streak = RejectionStreak(cfg.max_rejected_in_a_row)
        self.episode = Episode(
            EpisodeSettings(shared.run_name, shared.group_size, shared.sampling),
            self.rollouts,
            self.rewards,
            self.state,
            self.streak,
            on_rejected=self._rejected,
        )
        self.groups_per_call = groups_per_call(
            cfg.groups_per_call,
            shared.group_size,
            shared.max_response_length,
            shared.rpc.max_message_bytes,
        )
        self._lock = threading.Lock()
        self._inflight = 0
        self._wake = threading.Event()  # a slot freed, or the ledger moved

    def version(self) -> int:
        return self.state.version()

    def admit(self, batch: list[tuple[Cursor, PromptRecord]], version: int) -> list[Ticket]:
        """Record the groups as in flight (each atomically with the cursor and the ledger;
        all in one round trip)."""
        tickets = [
            Ticket(f"e{cursor.epoch}-{cursor.index - 1}", record.prompt_id, cursor.epoch, version)
            for cursor, record in batch
        ]
        self.state.admit([(t, cursor) for t, (cursor, _) in zip(tickets, batch, strict=True)])
        ADMITTED.inc(len(tickets))
        return tickets

    def _rejected(self, rejection: Rejection) -> None:
        self.errors.record(f"rejected {rejection.reason}", rejection.detail)

    def _play(
        self, tickets: list[Ticket], records: list[PromptRecord], stop: threading.Event
    ) -> None:
        started = time.monotonic()
        try:
            for outcome in self.episode.play_many(tickets, records, stop):
                if outcome is Outcome.PUBLISHED:
                    GROUP_SECONDS.observe(time.monotonic() - started)
        except Exception:  # the rejection itself failed (Redis gone): nothing else to do
            names = ", ".join(t.group_id for t in tickets)
            log.exception("groups %s could not be rejected; they stay in flight", names)
        finally:
            self._count(-len(tickets))
            self._wake.set()

    def _count(self, delta: int) -> int:
        with self._lock:
            self._inflight += delta
            INFLIGHT.set(self._inflight)
            return self._inflight

    def _submit(
        self,
        pool: ThreadPoolExecutor,
        stop: threading.Event,
        tickets: list[Ticket],
        records: list[PromptRecord],
    ) -> None:
        self._count(+len(tickets))
        pool.submit(self._play, tickets, records, stop)

    def resume_inflight(self, pool: ThreadPoolExecutor, stop: threading.Event) -> int:
        """Re-run groups a previous controller admitted but never published."""
        tickets = self.state.in_flight()
        for ticket in tickets:
            record = self.by_id.get(ticket.prompt_id)
            if record is None:  # the data changed, or now skips it at load: account for it
                gone = Rejection("unknown_prompt", "its prompt is not in the data as loaded")
                self.state.reject(ticket.group_id, ticket.prompt_id, gone)
                log.error(
                    "in-flight group %s: prompt %s is not in the data; rejected",
                    ticket.group_id,
                    ticket.prompt_id,
                )
                continue
            self._submit(pool, stop, [ticket], [record])
        return len(tickets)

    def publish_dataset(self) -> None:
        log.info("%s", self.data.describe())
        for warning in self.data.warnings:
            log.warning("data: %s", warning)
        for reason in {EMPTY, TOO_LONG, *self.data.filtered}:  # 0s too: not "No data"
            PROMPTS_FILTERED.labels(reason).set(self.data.filtered.get(reason, 0))
        self.state.publish_dataset(self.data.counts())

    def give_up(self, reason: str) -> None:
        """The run cannot make progress: say why in `failed` (`dapo up` stops the run)."""
        self.state.fail(reason)
        raise DapoError(reason)

    def _watch_ledger(self, stop: threading.Event) -> None:
        """Wake admission whenever the buffer or the learner moves the ledger."""
        while not stop.is_set():
            if self.state.wait_for_change(WATCH_S):
                self._wake.set()

    def run(self, stop: threading.Event) -> None:
        cfg, shared = self.config.controller, self.config.shared
        start = self.state.cursor()
        prompts = iterate(
            self.records, start, shared.seed, cfg.dataset.shuffle, cfg.dataset.answer_balance
        )
        self.state.reset_generating()
        self.publish_dataset()
        log.info("pass-rate histories of %d prompts loaded", self.state.load_pass_rates())
        evaluation = start_evaluation(self, stop)  # the eval curve (None when off)
        watcher = threading.Thread(target=self._watch_ledger, args=(stop,), daemon=True)
        watcher.start()
        try:
            with ThreadPoolExecutor(cfg.max_groups_in_flight + 1, "group") as pool:
                resumed = self.resume_inflight(pool, stop)
                log.info("controller starts at %s with %d groups resumed", start.encode(), resumed)
                try:
                    self._admit_until_done(pool, stop, prompts)
                finally:
                    stop.set()
                    cancelled = self.calls.cancel_all()  # their groups stay in flight
                    log.info("stopping: %d calls cancelled, their groups stay in flight", cancelled)
        finally:
            if evaluation is not None:
                evaluation.join(timeout=10)
            self.rewards.close()
            self.state.backlog.close()
            watcher.join(timeout=2 * WATCH_S)

    def _admit_until_done(
        self,
        pool: ThreadPoolExecutor,
        stop: threading.Event,
        prompts: Iterator[tuple[Cursor, PromptRecord]],
    ) -> None:
        """Admit while admission allows, else sleep until a slot frees or the ledger moves."""
        while not stop.is_set():
            self._wake.clear()  # before the snapshot: a change after it wakes the wait
            verdict = self.admission.check(self._count(0))
            INFORMATIVE_RATE.set(self.admission.informative_rate)
            if verdict.done:
                return
            if (hopeless := self.streak.verdict()) is not None:
                self.give_up(hopeless)
            if not verdict.admit:
                self._wake.wait(WAKE_S)
                continue
            wanted = min(verdict.room, self.groups_per_call)
            batch = [self._next_admissible(prompts) for _ in range(wanted)]
            records = [record for _, record in batch]
            self._submit(pool, stop, self.admit(batch, verdict.version), records)

    def _next_admissible(
        self, prompts: Iterator[tuple[Cursor, PromptRecord]]
    ) -> tuple[Cursor, PromptRecord]:
        """The next prompt difficulty-aware admission does not skip. Skipping costs no
        Redis: the cursor past the skipped prompts is written with the admission (a
        restart before it decides them again). Every prompt comes back after the epochs
        it sits out, so this ends."""
        while True:
            cursor, record = next(prompts)
            reason = self.admission.skip_reason(record.prompt_id)
            if reason is None:
                return cursor, record
            SKIPPED.labels(reason).inc()

    def status(self) -> dict[str, Any]:
        ledger = read_ledger(self.client, self.config.shared.run_name)
        return {
            "in_flight": self._count(0),
            "cursor": self.state.cursor().encode(),
            "version": self.version(),
            "prompts": len(self.records),
            "ledger": ledger.as_dict(),
            "last_error": self.errors.snapshot(),
        }


def limits(config: ControllerSettings) -> Limits:
    cfg, shared = config.controller, config.shared
    return Limits(
        max_in_flight=cfg.max_groups_in_flight,
        max_backlog=cfg.max_train_backlog,
        batch_groups=shared.train_batch_groups,
        max_staleness=shared.max_staleness,
        difficulty_window=cfg.difficulty_window,
        max_skip_epochs=cfg.difficulty_skip_epochs,
    )


def create_server(config: ControllerSettings, client: redis.Redis | None = None) -> LoopServer:
    """The controller and its HTTP endpoints (start() serves them, wait() runs the loop)."""
    controller = Controller(config, client or connect_run(config))
    return LoopServer("controller", controller, config.controller.server, config.security.auth)
