"""`dapo up` never hangs silently: the data is checked before any service starts, a stall
is shown with its cause, and a run that cannot make progress stops with one line saying why.

Bad data is a one-line error before launch; a stall past `stall_after_s` leads with the
dominant cause of the last `stall_after_s` seconds from the ledger's live counters (every
group filtered all_wrong, dropped stale, no rollout server ready...), then each service's
`last_error` and the ledger's counts; the run exits non-zero when a service
marked it hopeless (the run's `failed` key) or, when asked, after `stall_timeout_s`
without a step. docs/reliability.md, "Data checked at load" and "A stall says why".
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from services.common.data_screen import ScreenedData
from services.common.keys import RunKeys
from services.common.ledger import Ledger, read_ledger
from services.common.registry import discover
from services.common.tokenizer import PromptTokenizer, load_tokenizer
from services.controller.dataset import load_training_data
from services.tools.config import DapoConfig

READY_LINE = re.compile(r"^dapo (\w+) ready .*\bhttp=(\d+)", re.MULTILINE)
STATUS_TIMEOUT_S = 1.0
PROBE_EVERY_S = 10.0
REPEAT_S = 60.0


def check_training_data(
    config: DapoConfig, tokenizer: PromptTokenizer | None = None
) -> ScreenedData:
    """The training data as the controller will load it (its tokenizer: shared.model_path),
    or a DapoError saying what is wrong."""
    cfg, shared = config.controller, config.shared
    tokenizer = tokenizer or load_tokenizer(shared.model_path, cfg.apply_chat_template)
    verifier = config.reward.default_verifier if shared.verifier == "default" else shared.verifier
    return load_training_data(
        cfg.dataset, shared.seed, tokenizer, shared.max_prompt_length, verifier
    )


def run_failure(client: Any, keys: RunKeys) -> str | None:
    """The reason a service gave up on the run (the `failed` key), if one did."""
    raw = client.get(keys.failed)
    return raw.decode() if raw else None


class ServiceLog(Protocol):
    """What the watch needs of a launched service: its name, pid and log file."""

    @property
    def name(self) -> str: ...

    @property
    def pid(self) -> int: ...

    @property
    def log_path(self) -> Path: ...


def announced_http_port(log_path: Path) -> int | None:
    """The HTTP port in the last `dapo <role> ready ... http=N` line of a service's log."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return None
    found = READY_LINE.findall(text)
    return int(found[-1][1]) if found else None


def fetch_status(port: int, token: str | None) -> dict[str, Any] | None:
    """A service's /status (None if it does not answer within a second)."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}/status")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=STATUS_TIMEOUT_S) as response:
            return dict(json.loads(response.read()))
    except (OSError, ValueError):
        return None


def describe_error(error: dict[str, Any], now: float) -> str:
    """`rejected prompt_too_long ×12, 3s ago: prompt of 20 tokens exceeds ...`."""
    age = max(0.0, now - float(error["at"]))
    return f"{error['kind']} ×{error['count']}, {age:.0f}s ago: {error['message']}"


OUTCOMES = ("filtered", "dropped", "rejected")


def ledger_counts(ledger: Ledger) -> dict[str, int]:
    """The ledger's cumulative counts by outcome (`filtered all_wrong`, `dropped stale`,
    `rejected prompt_too_long`, `kept`, `trained`, `admitted`)."""
    out = {"admitted": ledger.admitted, "kept": ledger.kept, "trained": ledger.trained}
    by_outcome = (ledger.filtered, ledger.dropped, ledger.rejected)
    for outcome, counts in zip(OUTCOMES, by_outcome, strict=True):
        out.update({f"{outcome} {reason}": n for reason, n in counts.items()})
    return out


def counts_since(now: dict[str, int], then: dict[str, int]) -> dict[str, int]:
    return {k: v - then.get(k, 0) for k, v in now.items() if v - then.get(k, 0) > 0}


def dominant_cause(
    delta: dict[str, int], window_s: float, rollouts: list[dict[str, Any]], version: int
) -> str:
    """What happened to the groups of the last `window_s` seconds, in words: the outcome
    that took most of them (`every group (48) filtered all_wrong in the last 30s`), or
    that no rollout server is ready, or that nothing was decided at all."""
    window = f"in the last {window_s:.0f}s"
    ready = [r for r in rollouts if r.get("accepting")]
    if not ready:
        served = ", ".join(f"v{r.get('version', 0)}" for r in rollouts) or "none registered"
        return f"no rollout server ready (policy v{version}; rollout servers: {served})"
    outcomes = {k: n for k, n in delta.items() if k.split(" ")[0] in OUTCOMES}
    decided = sum(outcomes.values()) + delta.get("kept", 0)
    if decided == 0:
        return f"no group decided {window} ({delta.get('admitted', 0)} admitted)"
    if not outcomes or max(outcomes.values()) < delta.get("kept", 0):
        trained = delta.get("trained", 0)
        return f"{delta.get('kept', 0)} of {decided} groups kept {window}, {trained} trained"
    name, count = max(outcomes.items(), key=lambda item: item[1])
    share = f"every group ({count})" if count == decided else f"{count} of {decided} groups"
    line = f"{share} {name} {window}"
    if name.endswith(" stale"):
        versions = sorted({int(r.get("version", 0)) for r in ready})
        line += f" (policy v{version}, rollout servers at {versions}: lag {version - versions[0]})"
    return line


@dataclass
class StallWatch:
    """Seconds since the last completed step, and why, from the services' /status.

    While stalled, the services are asked every `stall_after_s` (at most every 10 s); a
    line is shown when the cause changes (another error kind somewhere), else once a
    minute.
    """

    stall_after_s: float
    stall_timeout_s: float = 0.0  # 0 = show the stall, never stop the run for it
    token: str | None = None
    last_step: int = 0
    last_progress: float = field(default_factory=time.monotonic)
    last_probe: float = 0.0
    last_shown: float = 0.0
    cause: str = ""
    signature: tuple[str, ...] = ()
    ports: dict[tuple[str, int], int] = field(default_factory=dict)
    # (time, ledger counts) of each probe: the live window the cause is read from
    history: list[tuple[float, dict[str, int]]] = field(default_factory=list)
    last_sample: float = 0.0

    def start(self) -> None:
        """Count from now (the services were just started)."""
        self.last_progress, self.cause, self.signature = time.monotonic(), "", ()

    def stalled_s(self, step: int) -> float:
        now = time.monotonic()
        if step != self.last_step:
            self.last_step = step
            self.start()
        return now - self.last_progress

    def observe(
        self, step: int, services: Sequence[ServiceLog], client: Any, run: str
    ) -> str | None:
        """A line to show while the run is stalled, when its cause changed (else None)."""
        stalled, now = self.stalled_s(step), time.monotonic()
        if now - self.last_sample >= min(PROBE_EVERY_S, self.stall_after_s / 3):
            self.last_sample = now  # the counts the next stall's cause is read against
            self.history.append((now, ledger_counts(read_ledger(client, run))))
            self.history = [h for h in self.history if now - h[0] <= 3 * self.stall_after_s]
        interval = min(PROBE_EVERY_S, self.stall_after_s)
        if stalled < self.stall_after_s or now - self.last_probe < interval:
            return None
        self.last_probe = now
        self.cause, signature = self.probe(services, client, run)
        if signature == self.signature and now - self.last_shown < REPEAT_S:
            return None
        self.signature, self.last_shown = signature, now
        return f"no training step for {stalled:.0f}s: {self.cause}"

    def timed_out(self, step: int) -> str | None:
        """The reason to stop when `stall_timeout_s` passed without a step."""
        stalled = self.stalled_s(step)
        if self.stall_timeout_s <= 0 or stalled < self.stall_timeout_s:
            return None
        cause = self.cause or "no service reported an error"
        return f"no training step for {stalled:.0f}s (--stall-timeout): {cause}"

    def probe(
        self, services: Sequence[ServiceLog], client: Any, run: str
    ) -> tuple[str, tuple[str, ...]]:
        """Each service's latest error, then where the groups are (the ledger); and the
        error kinds alone (what a change of cause is)."""
        now = time.time()
        ledger = read_ledger(client, run)
        keys = RunKeys(run)
        cause = self.live_cause(ledger, discover(client, keys, "rollout"))
        parts, kinds = [cause], [cause.split(" in the last")[0]]
        for service in services:
            status = self.status(service)
            error = status.get("last_error") if status else None
            if error:
                parts.append(f"{service.name}: {describe_error(error, now)}")
                kinds.append(f"{service.name}: {error['kind']}")
            elif status is None:
                parts.append(f"{service.name}: no answer on /status")
                kinds.append(f"{service.name}: silent")
        parts.append(
            f"groups admitted {ledger.admitted}, in flight {ledger.in_flight}, "
            f"rejected {ledger.rejected_total}, filtered {ledger.filtered_total}, "
            f"waiting to train {ledger.pending_train}"
        )
        return "; ".join(parts), tuple(kinds)

    def live_cause(self, ledger: Ledger, rollouts: list[dict[str, Any]]) -> str:
        """The dominant cause over the last `stall_after_s` seconds: the counts now less
        the newest sample at least that old (else the oldest one kept)."""
        now, counts = time.monotonic(), ledger_counts(ledger)
        old = [h for h in self.history if now - h[0] >= self.stall_after_s]
        base = old[-1] if old else (self.history[0] if self.history else (now, counts))
        delta = counts_since(counts, base[1])
        return dominant_cause(delta, now - base[0], rollouts, ledger.version)

    def status(self, service: ServiceLog) -> dict[str, Any] | None:
        """The service's /status (its HTTP port read once from its log's ready line)."""
        key = (service.name, service.pid)
        if key not in self.ports:
            port = announced_http_port(service.log_path)
            if port is None:
                return None
            self.ports[key] = port
        return fetch_status(self.ports[key], self.token)
