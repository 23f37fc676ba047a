"""Which run a `dapo up` starts or continues in its run directory (docs/runs.md).

A directory holds one run (`run.json`: its id, its segments). A plain `dapo up` starts a
run only in a directory that holds none; `--resume` continues the one it holds (or starts
one when it holds none: what a preemption script wants), `--fresh` moves it aside first.
On resume the saved config is compared with the new one: safe changes are applied with a
line each, changes that would make it another run are refused.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from services.common.errors import DapoError
from services.tools.config import DapoConfig
from services.tools.run_dir import (
    REDIS_DIR,
    RunRecord,
    holds_run,
    latest_checkpoint_step,
    load_run,
    mint_run_id,
    move_aside,
    read_record,
    write_record,
)

Mode = Literal["new", "resume", "fresh"]

# Settings a run cannot change and stay the same run (its model, data and objective).
RUN_CHANGING = (
    "shared.run_name",
    "shared.model_path",
    "shared.model_init",
    "learner.model_path",
    "rollout.model_path",
    "shared.group_size",
    "shared.max_prompt_length",
    "shared.max_response_length",
    "shared.overlong_buffer_length",
    "shared.verifier",
    "learner.objective.clip_ratio_low",
    "learner.objective.clip_ratio_high",
    "learner.objective.clip_ratio_c",
    "learner.objective.loss_agg_mode",
    "learner.engine",
    "learner.dtype",
    "learner.deepspeed.zero_stage",
    "controller.dataset",
    "controller.apply_chat_template",
)
# Not settings of the run: where `dapo up` put its pieces this time.
NOT_COMPARED = (
    "shared.redis_url",
    "security",
    "learner.checkpoint.dir",
    "learner.checkpoint.resume",
)


@dataclass
class Segment:
    """This `dapo up` of the run: the run's record, and where it starts."""

    record: RunRecord
    resumed: bool
    start_step: int
    started_at: float

    @property
    def run_id(self) -> str:
        return self.record.run_id


def begin(config: DapoConfig, run_dir: Path, mode: Mode) -> Segment:
    """The run this `dapo up` runs in `run_dir` (held locked): a new one, or the one the
    directory holds (`--resume`); refuses another run's directory with one line."""
    if mode == "fresh" and holds_run(run_dir):
        print(f"moved the run that was in {run_dir} to {move_aside(run_dir)}")
    if not holds_run(run_dir):
        if mode == "resume":
            print(f"{run_dir} holds no run to resume: starting a new one")
        record = RunRecord(mint_run_id(), config.shared.run_name)
        print(f"run {record.run_name} (id {record.run_id}) in {run_dir}")
        return Segment(record, False, 0, time.time())
    held = read_record(run_dir)
    if mode != "resume":
        raise DapoError(refusal(run_dir, held))
    if held is None:
        raise DapoError(
            f"{run_dir} holds a run of an older `dapo up` (no run.json) that cannot be resumed; "
            "`dapo up --fresh` moves it aside and starts a new run"
        )
    return resume(config, run_dir, held)


def refusal(run_dir: Path, record: RunRecord | None) -> str:
    who = f"run {record.run_name} (id {record.run_id}, {progress(record)})" if record else "a run"
    return (
        f"{run_dir} holds {who}: `dapo up --resume` continues it, `dapo up --fresh` moves it "
        f"aside to {run_dir.name}.old-<time> and starts a new run"
    )


def progress(record: RunRecord) -> str:
    """`stopped at step 16 of 40`, `finished at step 40`, from its last segment."""
    if not record.segments:
        return "never ran"
    last = record.segments[-1]
    step, total = last.get("end_step", last.get("start_step", 0)), last.get("total_steps")
    if last.get("exit_code") == 0:
        return f"finished at step {step}"
    return f"stopped at step {step} of {total}"


def resume(config: DapoConfig, run_dir: Path, record: RunRecord) -> Segment:
    """Continue the directory's run: its config's differences checked, its checkpoint
    restored by the learner, its Redis state (ledger, cursor, streams) kept."""
    saved = load_run(run_dir)
    for line in applied_changes(saved, config):
        print(line)
    own_redis = config.shared.redis_url is None
    if own_redis and not any((run_dir / REDIS_DIR).glob("*")):
        raise DapoError(
            f"{run_dir / REDIS_DIR} holds no Redis state (the run had shared.redis_appendonly: "
            "false): it cannot be resumed; `dapo up --fresh` starts a new run"
        )
    if config.learner.checkpoint.dir is None:
        config.learner.checkpoint.dir = saved.learner.checkpoint.dir
    config.learner.checkpoint.resume = True
    step = latest_checkpoint_step(config) or 0
    total = config.learner.total_steps
    if step >= total:
        raise DapoError(
            f"run {record.run_name} is at step {step} already: `--steps N` with N > {step} "
            "continues it"
        )
    where = f"its checkpoint step{step}" if step else "the start (no checkpoint yet)"
    print(f"resuming run {record.run_name} (id {record.run_id}) from {where} to step {total}")
    return Segment(record, True, step, time.time())


def applied_changes(saved: DapoConfig, new: DapoConfig) -> list[str]:
    """A line per setting changed since the run's last segment; DapoError naming every
    run-changing one."""
    old, now = flat(saved.model_dump(mode="json")), flat(new.model_dump(mode="json"))
    changed = [
        k
        for k in sorted(old.keys() | now.keys())
        if old.get(k) != now.get(k) and not compared(k, NOT_COMPARED) and not is_port(k)
    ]
    refused = [k for k in changed if compared(k, RUN_CHANGING)]
    if refused:
        what = ", ".join(f"{k} {old.get(k)!r} → {now.get(k)!r}" for k in refused)
        raise DapoError(
            f"--resume refused: {what} would make it another run; keep the saved value "
            "(config.yaml in the run directory) or start a new run with --fresh"
        )
    return [f"changed on resume: {k} {old.get(k)!r} → {now.get(k)!r}" for k in changed]


def compared(key: str, prefixes: tuple[str, ...]) -> bool:
    return any(key == p or key.startswith(f"{p}.") for p in prefixes)


def is_port(key: str) -> bool:
    """Ports `dapo up` picks itself (0: free)."""
    return key.endswith((".server.grpc_port", ".server.http_port"))


def flat(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat(value, f"{name}."))
        else:
            out[name] = value
    return out


def record_segment(run_dir: Path, segment: Segment, **fields: Any) -> None:
    """Write run.json with this segment's entry (added or updated)."""
    entry = {"started_at": round(segment.started_at, 3), "start_step": segment.start_step}
    entry.update(fields)
    segments = segment.record.segments
    if segments and segments[-1].get("started_at") == entry["started_at"]:
        segments[-1].update(entry)
    else:
        segments.append(entry)
    write_record(run_dir, segment.record)
