"""Which failures of a group's calls are worth another try, and why a group is rejected.

Transient (the server is gone, busy, slow or behind, or none is registered): retried with
backoff and re-routed, as before. Permanent (the server refuses the request itself, or
its answer cannot be decoded): another try gets the same answer, so the group is rejected
at once with a reason, which becomes a ledger counter (`rejected:<reason>`) and a metric
label. A refusing server names what it checked in the `dapo-refusal` trailing metadata
(services/common/errors.REFUSAL_KEY); reasons are a small fixed vocabulary.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass

import grpc

from services.common.errors import REFUSAL_KEY, one_line
from services.common.retry import RETRYABLE_CODES

# What a server's refusal names → the rejection reason (metric label, ledger counter).
REFUSALS = {
    "shared.max_prompt_length": "prompt_too_long",
    "prompt": "empty_prompt",
    "vocab_size": "prompt_out_of_vocab",
    "max_ground_truth_chars": "ground_truth_too_long",
    "max_response_chars": "response_too_long",
    "tokenizer": "tokenizer_mismatch",
}
# Reasons no other group can escape either: the run stops at the first (with its words).
FATAL = frozenset({"tokenizer_mismatch"})
DETAIL_CHARS = 300


@dataclass(frozen=True)
class Rejection:
    """Why a group can never succeed: `reason` is a label, `detail` the server's words."""

    reason: str
    detail: str


class GroupRejected(Exception):
    """Raised out of a group's work: the group is rejected, not retried."""

    def __init__(self, rejection: Rejection) -> None:
        super().__init__(f"{rejection.reason}: {rejection.detail}")
        self.rejection = rejection


def classify(exc: BaseException, target: str) -> Rejection | None:
    """None for a transient failure of a call to `target` (rollout/reward), else why the
    group is rejected."""
    if isinstance(exc, GroupRejected):
        return exc.rejection
    if isinstance(exc, ConnectionError | grpc.FutureCancelledError):
        return None
    if isinstance(exc, grpc.RpcError):
        return _classify_rpc(exc, target)
    if isinstance(exc, ValueError):  # an answer that does not decode or does not fit
        return Rejection(f"{target}_bad_response", _detail(str(exc)))
    return None


def _classify_rpc(exc: grpc.RpcError, target: str) -> Rejection | None:
    code = exc.code()
    if code in RETRYABLE_CODES:
        return None
    refusal = _refusal(exc)
    reason = REFUSALS.get(refusal or "", f"{target}_{code.name.lower()}")
    details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
    return Rejection(reason, _detail(details or code.name))


def _refusal(exc: grpc.RpcError) -> str | None:
    """The check a refusing server named in its trailing metadata, if any."""
    if not isinstance(exc, grpc.Call):
        return None
    for key, value in exc.trailing_metadata() or ():
        if key == REFUSAL_KEY:
            return value if isinstance(value, str) else value.decode()
    return None


def _detail(text: str) -> str:
    text = one_line(text)
    return text if len(text) <= DETAIL_CHARS else text[: DETAIL_CHARS - 1] + "…"


class RejectionStreak:
    """Groups rejected in a row, with no group scored between them: past `limit` the run
    cannot make progress (every prompt refused, every ground truth too long) and the
    controller stops it with a reason instead of rejecting forever; 0 = never."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._reasons: Counter[str] = Counter()
        self._example = ""
        self._fatal: Rejection | None = None

    def rejected(self, rejection: Rejection) -> None:
        with self._lock:
            self._reasons[rejection.reason] += 1
            self._example = rejection.detail
            if rejection.reason in FATAL:
                self._fatal = rejection

    def success(self) -> None:
        with self._lock:
            self._reasons.clear()

    def verdict(self) -> str | None:
        """None while progress is possible, else the one-line reason to stop."""
        with self._lock:
            if self._fatal is not None:
                return f"{self._fatal.reason}: {self._fatal.detail}"
            n = sum(self._reasons.values())
            if self.limit == 0 or n < self.limit:
                return None
            reasons = ", ".join(f"{r} {k}" for r, k in self._reasons.most_common())
            return (
                f"the last {n} groups were all rejected ({reasons}), none scored; "
                f"e.g. {self._example}"
            )


class Stopped(Exception):
    """Raised out of a group's work when the controller stops: the group stays in flight,
    and the next controller re-runs it."""


CONTROLLER_ERROR = "controller_error"


def unexpected(exc: BaseException) -> Rejection:
    """An exception nobody classified (a bug, a malformed record): the group is rejected
    with its type and text rather than left in flight."""
    return Rejection(CONTROLLER_ERROR, _detail(f"{type(exc).__name__}: {exc}"))
