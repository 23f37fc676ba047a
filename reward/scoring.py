"""The service core, free of gRPC and HTTP: check limits, verify in the pool, shape, count.

Both front ends (gRPC `RewardService.Score` and `POST /v1/score`) translate their
messages to `ScoreInput`s and back from `ScoreOutput`s and call `Scorer.score`; a
`ScoreLimitExceeded` becomes INVALID_ARGUMENT or HTTP 422/413 naming the limit.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from reward import metrics
from reward.inline import runs_inline, verify_inline
from reward.jobs import Outcome, Task
from reward.pool import VerifierPool
from reward.shaping import OverlongShaping, is_overlong

CORRECT_REWARD = 1.0
WRONG_REWARD = -1.0


@dataclass(frozen=True)
class ScoreInput:
    """One response to score. `verifier=None` = the configured default; length 0 = unshaped."""

    response: str
    ground_truth: str
    id: str = ""
    verifier: str | None = None
    response_length: int = 0
    truncated: bool = False


@dataclass(frozen=True)
class ScoreOutput:
    """The verdict on one item; `reward` already includes `overlong_penalty`."""

    id: str
    reward: float
    correct: bool
    pred: str
    verifier: str
    error: str
    overlong_penalty: float
    truncated: bool


@dataclass(frozen=True)
class Limits:
    """Request bounds (invariant 7: bounded input, clear refusal)."""

    max_items: int
    max_response_chars: int
    max_ground_truth_chars: int


class RequestError(ValueError):
    """The request is unusable as sent: INVALID_ARGUMENT / HTTP `http_status`."""

    def __init__(self, message: str, http_status: int = 422) -> None:
        super().__init__(message)
        self.http_status = http_status


class ScoreLimitExceeded(RequestError):
    """A Score request breaks a limit; `limit` names it, `http_status` is 422 or 413."""

    def __init__(self, limit: str, message: str, http_status: int = 422) -> None:
        super().__init__(message, http_status)
        self.limit = limit


def check_limits(items: Sequence[ScoreInput], limits: Limits) -> None:
    """Raise ScoreLimitExceeded for the first limit the request breaks."""
    if len(items) > limits.max_items:
        raise ScoreLimitExceeded(
            "max_items", f"{len(items)} items > shared.rpc.max_score_items={limits.max_items}"
        )
    for index, item in enumerate(items):
        if len(item.response) > limits.max_response_chars:
            raise ScoreLimitExceeded(
                "max_response_chars",
                f"item {index}: response has {len(item.response)} characters > "
                f"reward.max_response_chars={limits.max_response_chars}",
            )
        if len(item.ground_truth) > limits.max_ground_truth_chars:
            raise ScoreLimitExceeded(
                "max_ground_truth_chars",
                f"item {index}: ground_truth has {len(item.ground_truth)} characters > "
                f"reward.max_ground_truth_chars={limits.max_ground_truth_chars}",
            )


class Scorer:
    """Limits → verification (bounded rules inline, the rest in the pool) → correctness
    reward + overlong penalty → metrics."""

    def __init__(
        self,
        pool: VerifierPool,
        limits: Limits,
        shaping: OverlongShaping,
        default_verifier: str,
        inline_rules: bool = True,
    ) -> None:
        self.pool, self.limits, self.shaping = pool, limits, shaping
        self.default_verifier = default_verifier
        self.inline_rules = inline_rules
        self.items_scored = 0

    def score(self, items: Sequence[ScoreInput], transport: str = "direct") -> list[ScoreOutput]:
        """Score a batch; raises only ScoreLimitExceeded (before any work is done)."""
        start = time.perf_counter()
        try:
            check_limits(items, self.limits)
        except ScoreLimitExceeded as exc:
            metrics.REJECTED.labels(exc.limit).inc()
            raise
        tasks = [
            Task(item.verifier or self.default_verifier, item.response, item.ground_truth)
            for item in items
        ]
        inline = [self.inline_rules and runs_inline(task) for task in tasks]
        to_pool = [task for task, here in zip(tasks, inline, strict=True) if not here]
        pooled = iter(self.pool.submit_all(to_pool))
        outcomes: list[Outcome] = []
        outputs: list[ScoreOutput] = []
        # Shape each item as its verdict arrives, while the workers verify the rest.
        for item, task, here in zip(items, tasks, inline, strict=True):
            outcomes.append(verify_inline(task) if here else next(pooled).result())
            outputs.append(self._shape(item, outcomes[-1]))
        self._record(outputs, outcomes, transport, time.perf_counter() - start)
        return outputs

    def _shape(self, item: ScoreInput, outcome: Outcome) -> ScoreOutput:
        verdict = outcome.verdict
        penalty = self.shaping.penalty(item.response_length)
        metrics.VERIFY_SECONDS.observe(outcome.seconds)
        return ScoreOutput(
            id=item.id,
            reward=(CORRECT_REWARD if verdict.correct else WRONG_REWARD) + penalty,
            correct=verdict.correct,
            pred=verdict.pred,
            verifier=verdict.verifier,
            error=verdict.error,
            overlong_penalty=penalty,
            truncated=is_overlong(item.response_length, self.shaping.max_len, item.truncated),
        )

    def _record(
        self, outputs: list[ScoreOutput], outcomes: list[Outcome], transport: str, seconds: float
    ) -> None:
        """Metrics for one request; counters once per (verifier, outcome), not per item."""
        for (verifier, kind), n in Counter(map(_outcome_kind, outcomes)).items():
            metrics.ITEMS.labels(verifier, kind).inc(n)
            if kind == "timeout":
                metrics.TIMEOUTS.inc(n)
            elif kind == "error":
                metrics.ERRORS.inc(n)
        self.items_scored += len(outputs)
        metrics.REQUEST_SECONDS.labels(transport).observe(seconds)
        if outputs:
            metrics.CORRECT_RATE.set(sum(o.correct for o in outputs) / len(outputs))

    def status(self) -> dict[str, object]:
        """What /status shows."""
        return {
            "ready": self.pool.ready,
            "workers": self.pool.num_workers,
            "worker_pids": self.pool.worker_pids(),
            "pool_restarts": self.pool.restarts,
            "items_scored": self.items_scored,
            "default_verifier": self.default_verifier,
            "timeout_s": self.pool.timeout_s,
        }


def _outcome_kind(outcome: Outcome) -> tuple[str, str]:
    """(verifier, correct/wrong/error/timeout) of one item, for the outcome counters."""
    verdict = outcome.verdict
    if outcome.timed_out:
        return verdict.verifier, "timeout"
    if verdict.error:
        return verdict.verifier, "error"
    return verdict.verifier, "correct" if verdict.correct else "wrong"
