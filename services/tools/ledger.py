"""`dapo ledger`: print where every admitted group of a run is, and whether the ledger
identity holds (the identities themselves are in services/common/ledger.py)."""

from __future__ import annotations

import json
import sys

from services.common.errors import DapoError
from services.common.ledger import Ledger, read_ledger
from services.common.redis_server import connect_run
from services.common.settings import RoleSettings


def format_ledger(ledger: Ledger) -> str:
    rows = [
        ("admitted", ledger.admitted),
        ("in flight (controller)", ledger.in_flight),
        ("scored", ledger.scored),
        ("pending in `scored`", ledger.pending_scored),
        ("kept (informative)", ledger.kept),
        *((f"filtered: {k}", v) for k, v in sorted(ledger.filtered.items())),
        ("pending in `train`", ledger.pending_train),
        *((f"dropped: {k}", v) for k, v in sorted(ledger.dropped.items())),
        ("trained", ledger.trained),
        *((f"rejected: {k}", v) for k, v in sorted(ledger.rejected.items())),
        *dataset_rows(ledger.dataset),
        ("informative groups dropped as stale", ledger.stale_dropped),
        ("policy version", ledger.version),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [f"{name:<{width}}  {value}" for name, value in rows]
    problems = ledger.problems()
    lines.append("identity holds" if not problems else "MISMATCH: " + "; ".join(problems))
    return "\n".join(lines)


def dataset_rows(dataset: dict) -> list[tuple[str, int]]:
    """The prompts as loaded: rows, used, and skipped at load by reason."""
    if not dataset:
        return []
    skipped = [(f"prompts skipped at load: {k}", v) for k, v in sorted(dataset["filtered"].items())]
    return [("dataset rows", dataset["rows"]), ("prompts used", dataset["usable"]), *skipped]


def print_ledger(config: RoleSettings, as_json: bool = False) -> int:
    """`dapo ledger`: print the run's ledger; exit 1 on any mismatch."""
    if not config.shared.redis_url:
        raise DapoError("pass --redis-url (or set shared.redis_url) to read a run's ledger")
    ledger = read_ledger(connect_run(config), config.shared.run_name)
    print(json.dumps(ledger.as_dict(), indent=2) if as_json else format_ledger(ledger))
    if ledger.problems():
        print("ledger mismatch", file=sys.stderr)
        return 1
    return 0
