"""CPU seconds per training step, by role: the line of `dapo up`'s summary that says what
the services cost beside the model and the learner.

Each process's CPU comes from /proc (Linux; its live descendants included, so a
reward's workers count as the reward's and a torchrun's ranks as the learner's); the
rollout server's model work from its /status (`model_cpu_s`, the torch engine's
measure), so that what the rollout server spends outside the model counts as service
overhead. Sampled when the step moves (at most every `every_s`), from the first step
seen to the last: start-up, the evaluations before and after and the final export are
outside the window.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

SERVICES = ("controller", "buffer", "reward", "redis", "dapo up")


def process_table() -> dict[int, tuple[int, float]]:
    """pid → (parent pid, user + system CPU seconds) of every live process."""
    tick = os.sysconf("SC_CLK_TCK")
    table: dict[int, tuple[int, float]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # exited meanwhile
            continue
        table[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    return table


def tree_cpu(root: int, table: Mapping[int, tuple[int, float]]) -> float:
    """CPU seconds of `root` and its live descendants."""
    family, frontier = {root}, {root}
    while frontier:
        frontier = {pid for pid, (parent, _) in table.items() if parent in frontier} - family
        family |= frontier
    return sum(table[pid][1] for pid in family if pid in table)


def cpu_seconds(root: int) -> float:
    """User + system CPU seconds of `root` and every live descendant."""
    return tree_cpu(root, process_table())


@dataclass
class Sample:
    step: int
    by_role: dict[str, float]  # CPU seconds so far
    model: float | None  # the rollout servers' model work so far (None: not measured)


@dataclass
class CpuMeter:
    """Samples of CPU by role as steps go by; `per_step` divides the window's growth."""

    every_s: float = 1.0
    samples: list[Sample] = field(default_factory=list)
    _last: float = 0.0
    _origin: int | None = None  # the step first seen: a resumed run starts past 0

    def observe(
        self,
        step: int,
        pids: Callable[[], Mapping[str, list[int]]],
        model: Callable[[], float | None],
    ) -> None:
        """A sample when `step` moved past the last sample's (the first: past the step
        first seen, so a resumed run's window starts at a step it trained, not while its
        services start) and `every_s` has passed. `pids()`: each role's process roots (a
        role's own process only for `dapo up`)."""
        now = time.monotonic()
        if self._origin is None:
            self._origin = step
        last = self.samples[-1].step if self.samples else self._origin
        if step <= last:
            return
        if self.samples and now - self._last < self.every_s:
            return
        table = process_table()
        own = table.get(os.getpid(), (0, 0.0))[1]
        by_role = {
            role: own if role == "dapo up" else sum(tree_cpu(p, table) for p in roots)
            for role, roots in pids().items()
        }
        self.samples.append(Sample(step, by_role, model()))
        self._last = now

    def per_step(self) -> dict[str, object] | None:
        """CPU seconds per step by role over the window, `services` (controller, buffer,
        reward, Redis, `dapo up` and the rollout servers outside the model) and `model`;
        None with fewer than two samples. A role whose CPU fell (its process restarted
        in the window) is left out, and so is the sum it belongs to."""
        if len(self.samples) < 2:
            return None
        # The window: the first and last samples that read the model's CPU (a /status
        # that did not answer in time leaves a sample without it), else all of them.
        measured = [s for s in self.samples if s.model is not None]
        if len(measured) < 2 or measured[-1].step == measured[0].step:
            measured = self.samples
        first, last = measured[0], measured[-1]
        steps = last.step - first.step
        roles = {r: (last.by_role[r] - first.by_role.get(r, 0.0)) / steps for r in last.by_role}
        roles = {r: v for r, v in roles.items() if v >= 0}
        out: dict[str, object] = {"steps": steps, "by_role": rounded(roles)}
        model = None
        if first.model is not None and last.model is not None and "rollout" in roles:
            model = (last.model - first.model) / steps
            out["model"] = round(model, 4)
            out["rollout_outside_model"] = round(roles["rollout"] - model, 4)
        if all(r in roles for r in SERVICES) and model is not None:
            out["services"] = round(sum(roles[r] for r in SERVICES) + roles["rollout"] - model, 4)
        return out


def rounded(values: Mapping[str, float]) -> dict[str, float]:
    return {k: round(v, 4) for k, v in values.items()}


def cpu_line(cpu: Mapping[str, object]) -> str:
    """`CPU per step (s): services 0.081 (controller 0.020, ...); model 0.052, learner 0.130`."""
    roles = cpu["by_role"]
    assert isinstance(roles, dict)
    parts = [f"{r} {roles[r]:.3f}" for r in SERVICES if r in roles]
    outside = cpu.get("rollout_outside_model")
    if outside is not None:
        parts.append(f"rollout outside the model {outside:.3f}")
    services = cpu.get("services")
    head = f"services {services:.3f}" if services is not None else "services (not measured)"
    tail = [f"{k} {cpu[k]:.3f}" for k in ("model",) if cpu.get(k) is not None]
    tail += [f"learner {roles['learner']:.3f}"] if "learner" in roles else []
    return f"CPU per step (s, over {cpu['steps']} steps): {head} ({', '.join(parts)}); " + (
        ", ".join(tail) or "model and learner not measured"
    )
