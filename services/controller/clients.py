"""Typed clients of the rollout and reward services: the controller's only gRPC seams.

Each call takes and returns our types (a PromptRecord, Samples); the protobufs stay in
`adapter`. A transiently failed call is retried with backoff (and a rollout call is
re-routed); a permanent failure raises GroupRejected (failures.py); stopping raises
Stopped and cancels the running calls. The training groups and the eval curve share
these clients, so they share routing, retries and score batching.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from prometheus_client import Counter

from dapo.v1 import reward_pb2, rollout_pb2, rollout_pb2_grpc
from dapo.v1.reward_pb2_grpc import RewardServiceStub
from services.common.data import PromptRecord
from services.common.error_log import ErrorLog
from services.common.grpc_server import channel
from services.common.retry import Backoff, RetriesExhausted, call_with_retry
from services.common.security import SecurityConfig
from services.common.server_config import RpcConfig
from services.common.settings import SamplingConfig
from services.common.types import Sample
from services.controller import adapter
from services.controller.episode import Generated
from services.controller.failures import GroupRejected, Stopped, classify, unexpected
from services.controller.routing import Router
from services.controller.scoring import ScoreBatcher

log = logging.getLogger(__name__)

RETRIES = Counter("dapo_controller_retries_total", "Failed calls retried", ["target"])

T = TypeVar("T")


class Calls:
    """The running gRPC calls (so that stopping can cancel them) and one channel per
    address and service (thread-safe)."""

    def __init__(self, security: SecurityConfig, max_message_bytes: int) -> None:
        self.security, self.limit = security, max_message_bytes
        self._lock = threading.Lock()
        self._running: set[grpc.Future] = set()
        self._rollouts: dict[str, rollout_pb2_grpc.RolloutServiceStub] = {}
        self._rewards: dict[str, RewardServiceStub] = {}

    def rollout(self, address: str) -> rollout_pb2_grpc.RolloutServiceStub:
        with self._lock:
            if address not in self._rollouts:
                chan = channel(address, self.security, self.limit)
                self._rollouts[address] = rollout_pb2_grpc.RolloutServiceStub(chan)
            return self._rollouts[address]

    def reward(self, address: str) -> RewardServiceStub:
        with self._lock:
            if address not in self._rewards:
                self._rewards[address] = RewardServiceStub(
                    channel(address, self.security, self.limit)
                )
            return self._rewards[address]

    @contextmanager
    def tracked(self, call: grpc.Future) -> Iterator[grpc.Future]:
        with self._lock:
            self._running.add(call)
        try:
            yield call
        finally:
            with self._lock:
                self._running.discard(call)

    def cancel_all(self) -> int:
        """Cancel every running call; their groups stay in flight (handed back)."""
        with self._lock:
            running = list(self._running)
        for call in running:
            call.cancel()
        return len(running)


class Retrier:
    """attempt() with backoff while it fails transiently (failures.classify)."""

    def __init__(self, rpc: RpcConfig, errors: ErrorLog) -> None:
        self.backoff = Backoff(rpc.backoff_base_s, rpc.backoff_cap_s)
        self.errors = errors

    def run(
        self, attempt: Callable[[], T], target: str, request_id: str, stop: threading.Event
    ) -> T:
        """attempt()'s result; Stopped when `stop` ends the retries, GroupRejected at once
        on a permanent failure."""

        def on_retry(exc: BaseException, delay: float) -> None:
            if stop.is_set():  # a call cancelled by stopping: no failure, no retry
                return
            RETRIES.labels(target).inc()
            text = error_text(exc)
            self.errors.record(f"{target} {error_class(exc)}", text)
            if not isinstance(exc, ConnectionError):
                log.warning(
                    "%s for %s failed, retrying in %.2fs: %s", target, request_id, delay, text
                )

        try:
            return call_with_retry(
                attempt,
                self.backoff,
                retryable=lambda e: classify(e, target) is None,
                stop=stop,
                on_retry=on_retry,
            )
        except RetriesExhausted as exc:
            raise Stopped(request_id) from exc
        except Exception as exc:
            rejection = classify(exc, target)
            if rejection is None:
                raise
            raise GroupRejected(rejection) from exc


@dataclass(frozen=True)
class RolloutSettings:
    """What every GenerateGroup call of a run shares."""

    max_tokens: int
    tokenizer_fingerprint: str  # of the tokenizer that made the records' prompt ids
    timeout_s: float


class RolloutClient:
    """GenerateGroup on the least-loaded accepting rollout server, re-routed on failure."""

    def __init__(
        self, router: Router, calls: Calls, retrier: Retrier, settings: RolloutSettings
    ) -> None:
        self.router, self.calls, self.retrier, self.settings = router, calls, retrier, settings

    def generate(
        self,
        request_id: str,
        record: PromptRecord,
        n: int,
        sampling: SamplingConfig,
        min_version: int,
        stop: threading.Event,
    ) -> Generated:
        """n samples of `record` from a policy at least `min_version` (GenerateGroup writes
        nothing, so repeating it is safe)."""
        request = self._request(request_id, record, n, sampling, min_version)
        return self.retrier.run(lambda: self._attempt(request), "rollout", request_id, stop)

    def generate_many(
        self,
        asks: Sequence[tuple[str, PromptRecord]],
        n: int,
        sampling: SamplingConfig,
        min_version: int,
        stop: threading.Event,
        priority: int = 0,
    ) -> list[Generated]:
        """generate() for several (request id, record) in one GenerateGroups call, in
        order (`priority`: GenerateRequest.priority). One refused group refuses the call
        (GroupRejected): ask per group then."""
        batch = rollout_pb2.GenerateGroupsRequest(
            groups=[
                self._request(i, record, n, sampling, min_version, priority) for i, record in asks
            ]
        )
        return self.retrier.run(lambda: self._attempt_many(batch), "rollout", named(asks), stop)

    def _request(
        self,
        request_id: str,
        record: PromptRecord,
        n: int,
        sampling: SamplingConfig,
        least: int,
        priority: int = 0,
    ) -> rollout_pb2.GenerateRequest:
        s = self.settings
        return adapter.generate_request(
            request_id,
            record,
            n,
            sampling,
            s.max_tokens,
            s.tokenizer_fingerprint,
            min_version=least,
            priority=priority,
        )

    def _attempt(self, request: rollout_pb2.GenerateRequest) -> Generated:
        timeout = self.settings.timeout_s
        response = self._routed(1, lambda stub: stub.GenerateGroup.future(request, timeout=timeout))
        return Generated(*adapter.samples_from_group(response, request.n))

    def _attempt_many(self, batch: rollout_pb2.GenerateGroupsRequest) -> list[Generated]:
        timeout = self.settings.timeout_s
        response = self._routed(
            len(batch.groups), lambda stub: stub.GenerateGroups.future(batch, timeout=timeout)
        )
        return [Generated(*group) for group in adapter.samples_from_groups(response, batch)]

    def _routed(
        self, groups: int, call: Callable[[rollout_pb2_grpc.RolloutServiceStub], grpc.Future]
    ) -> Any:
        """call()'s answer from the least-loaded accepting server (`groups` count as its
        load); a server that answered UNAVAILABLE is routed around."""
        with self.router.rollout(groups) as address:
            if address is None:
                raise ConnectionError("no ready rollout server")
            try:
                future = call(self.calls.rollout(address))
                with self.calls.tracked(future):
                    return future.result()
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.UNAVAILABLE:
                    self.router.shun(address)
                raise


def named(asks: Sequence[tuple[str, PromptRecord]], most: int = 16) -> str:
    """A batch's request ids for the logs: all of them (comma-joined) up to `most`."""
    ids = [request_id for request_id, _ in asks]
    if len(ids) <= most:
        return ",".join(ids)
    return f"{','.join(ids[:most])} and {len(ids) - most} more"


def groups_per_call(wanted: int, n: int, max_tokens: int, max_message_bytes: int) -> int:
    """`wanted`, or fewer so that a GenerateGroups answer fits in half the message limit
    (a completion's per-token arrays are at most 16 bytes a token, plus its text)."""
    per_group = n * (24 * max_tokens + 256)
    return max(1, min(wanted, max_message_bytes // 2 // per_group))


class RewardClient:
    """Score on the registered reward service; groups finishing together share a call."""

    def __init__(
        self, router: Router, calls: Calls, retrier: Retrier, verifier: str, rpc: RpcConfig
    ) -> None:
        self.router, self.calls, self.retrier, self.verifier = router, calls, retrier, verifier
        self.timeout_s = rpc.score_timeout_s
        self.batcher = ScoreBatcher(self._call, rpc.max_score_items, rpc.max_message_bytes // 2)

    def score(
        self, request_id: str, samples: list[Sample], ground_truth: str, stop: threading.Event
    ) -> list[Sample]:
        """`samples` with their verdicts (a pure function of the request: safe to retry)."""
        request = adapter.score_request(samples, ground_truth, self.verifier, request_id)

        def attempt() -> list[Sample]:
            adapter.apply_scores(samples, self.batcher.score(request))
            return samples

        return self.retrier.run(attempt, "reward", request_id, stop)

    def score_many(
        self, asks: Sequence[tuple[str, list[Sample], str]], stop: threading.Event
    ) -> list[list[Sample] | BaseException]:
        """score() for several (request id, samples, ground truth) at once (their requests
        share calls); each entry is the scored samples or why that group failed for good."""
        requests = [
            adapter.score_request(samples, truth, self.verifier, request_id)
            for request_id, samples, truth in asks
        ]
        out: list[list[Sample] | BaseException] = []
        for (request_id, samples, truth), answer in zip(
            asks, self.batcher.score_many(requests), strict=True
        ):
            if isinstance(answer, BaseException):  # this group alone, with retries
                try:
                    out.append(self.score(request_id, samples, truth, stop))
                except GroupRejected as exc:
                    out.append(exc)
                continue
            try:
                adapter.apply_scores(samples, answer)
            except ValueError as exc:
                out.append(GroupRejected(classify(exc, "reward") or unexpected(exc)))
                continue
            out.append(samples)
        return out

    def _call(self, request: reward_pb2.ScoreRequest) -> reward_pb2.ScoreResponse:
        rewards = self.router.instances("reward")
        if not rewards:
            raise ConnectionError("no reward service registered")
        future = self.calls.reward(rewards[0]["address"]).Score.future(
            request, timeout=self.timeout_s
        )
        with self.calls.tracked(future):
            response: reward_pb2.ScoreResponse = future.result()
            return response

    def close(self) -> None:
        self.batcher.close()


def error_class(exc: BaseException) -> str:
    """A failure's class in a word: the gRPC status code, else the exception type."""
    if isinstance(exc, grpc.RpcError) and isinstance(exc, grpc.Call):
        return str(exc.code().name)
    return type(exc).__name__


def error_text(exc: BaseException) -> str:
    """`CODE: details` of a gRPC error (its str() is a multi-line dump), else str()."""
    if isinstance(exc, grpc.RpcError) and isinstance(exc, grpc.Call):
        return f"{exc.code().name}: {exc.details()}"
    return str(exc)
