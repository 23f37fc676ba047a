"""The ablation ladder's plan: the techniques, their config switches, the presets and
each rung's config (`dapo ablate`, services/tools/ablate.py)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.common.config_loader import cli_overrides, deep_merge
from services.common.errors import DapoError
from services.tools.config import DapoConfig, build_config, load_config


@dataclass(frozen=True)
class Technique:
    """One switch: the config path it sets and its value when the technique is off."""

    name: str
    label: str
    path: str
    off: Callable[[DapoConfig], Any]


# In the paper's order (Table 1); "on" is the base config's own value.
TECHNIQUES: tuple[Technique, ...] = (
    Technique(
        "overlong_filtering",
        "+ overlong filtering",
        "learner.objective.overlong_filtering",
        lambda c: False,
    ),
    Technique(
        "clip_higher",
        "+ clip-higher",
        "learner.objective.clip_ratio_high",
        lambda c: c.learner.objective.clip_ratio_low,
    ),
    Technique(
        "soft_overlong", "+ soft overlong punishment", "reward.overlong_punishment", lambda c: False
    ),
    Technique(
        "token_level_loss",
        "+ token-level loss",
        "learner.objective.loss_agg_mode",
        lambda c: "seq_mean_token_mean",
    ),
    Technique(
        "dynamic_sampling",
        "+ dynamic sampling (= DAPO)",
        "buffer.dynamic_sampling",
        lambda c: False,
    ),
)
RUNG_NAMES = ("naive_grpo", *(t.name for t in TECHNIQUES))
RUNG_LABELS = dict(zip(RUNG_NAMES, ("naive GRPO", *(t.label for t in TECHNIQUES)), strict=True))
HIGH_TARGET = 0.8  # the second "steps to" held-out accuracy (the first is the preset's)
# Leave-one-out: full DAPO with one technique off (`--leave-one-out`, after the ladder).
LOO_NAMES = tuple(f"no_{t.name}" for t in TECHNIQUES)
RUNG_LABELS |= {
    f"no_{t.name}": "DAPO without " + t.label[2:].removesuffix(" (= DAPO)") for t in TECHNIQUES
}

# `--preset tiny_runmax`: the `tiny_runmax` preset on `runmax` (services/common/reasoning.py): a
# scratchpad of 2-6 steps and the paper's `Answer:` line, scored by the `dapo` rule. The
# reference response is 6-14 tokens; L_max 20 with a soft zone of 4 tokens (punished
# from 17 on), so a random model is truncated about 30% of the time (docs/tasks.md).
RUNMAX: dict[str, Any] = {
    "shared.max_response_length": 20,
    "shared.overlong_buffer_length": 4,
    "controller.dataset.synthetic_task": "runmax",
    "shared.verifier": "dapo",
    "learner.total_steps": 100,  # full DAPO passed 0.8 held-out at step 75-95 (2 runs)
}
# `--preset tiny_mixed`: the earlier ladder: the tiny demo preset on
# `mixed` (max3 + copy2) with first-integer answers. L_max 6 and a soft zone of 3
# tokens: a random model is truncated ~2/3 of the time, a finished answer ("7<eos>") is 2.
MIXED: dict[str, Any] = {
    "shared.max_response_length": 6,
    "shared.overlong_buffer_length": 3,
    "controller.dataset.synthetic_task": "mixed",
    "shared.verifier": "first_integer",
    "learner.total_steps": 80,
}
_LADDER: dict[str, Any] = {
    "controller.eval.enabled": False,
    "reward.overlong_punishment": True,
    "learner.objective.overlong_filtering": True,
    "learner.linger_s": 30,
    # The ladder measures the paper's dynamic sampling: every prompt every epoch, each
    # batch refilled until full (the `tiny` preset bounds it: docs/architecture.md).
    "controller.difficulty_window": 0,
    "learner.generation_budget": None,
}
ABLATE_PRESETS: dict[str, dict[str, Any]] = {
    name: {
        "base": base,
        "overrides": {**task, **_LADDER},
        "eval_every": 5,
        "eval_n": 4,
        "target": 0.5,
    }
    for name, base, task in (("tiny_runmax", "tiny_runmax", RUNMAX), ("tiny_mixed", "tiny", MIXED))
}
# `--preset demo`: `dapo up --preset tiny` (`make demo`: max3), its in-run curve replaced
# by the ablation's own evaluation and with the paper's clip-higher (the preset runs
# without it: its comment says why), for rungs that switch one technique (e.g. `--rungs
# dynamic_sampling,no_clip_higher`: DAPO, and DAPO with ε_high = ε_low, = the preset).
ABLATE_PRESETS["demo"] = {
    "base": "tiny",
    "overrides": {
        "controller.eval.enabled": False,
        "learner.total_steps": 150,
        "learner.objective.clip_ratio_high": 0.28,
    },
    "eval_every": 10,
    "eval_n": 4,
    "target": 0.9,
}


@dataclass
class Plan:
    """What one `dapo ablate` runs."""

    name: str
    base: DapoConfig
    rungs: list[str]
    seeds: list[int]
    steps: int
    eval_every: int
    eval_n: int
    target: float
    target_high: float = HIGH_TARGET
    root: str = "runs"
    overrides: list[str] = field(default_factory=list)

    @property
    def out_dir(self) -> Path:
        return Path(self.root) / f"ablate-{self.name}"


def rung_overrides(base: DapoConfig, rung: str) -> dict[str, Any]:
    """The switches of a rung: on the ladder every technique before it (in paper order) on
    and the rest off; leave-one-out (`no_<technique>`) every technique on but that one."""
    if rung in LOO_NAMES:
        return {
            t.path: t.off(base) if rung == f"no_{t.name}" else _get(base, t.path)
            for t in TECHNIQUES
        }
    if rung not in RUNG_NAMES:
        names = ", ".join((*RUNG_NAMES, *LOO_NAMES))
        raise DapoError(f"unknown rung {rung!r}; choose from: {names}")
    on = RUNG_NAMES.index(rung)  # naive_grpo = 0 techniques on
    return {t.path: _get(base, t.path) if i < on else t.off(base) for i, t in enumerate(TECHNIQUES)}


def _get(config: Any, path: str) -> Any:
    for part in path.split("."):
        config = getattr(config, part)  # probe-ok: a dotted config path, part by part
    return config


def as_sets(values: dict[str, Any]) -> list[str]:
    """`{"a.b": 1}` → `["a.b=1"]` in the `--set` syntax (JSON values parse as YAML)."""
    return [f"{k}={json.dumps(v)}" for k, v in values.items()]


def run_config(plan: Plan, rung: str, seed: int) -> DapoConfig:
    """The full config of one run: base, the rung's switches, the seed and its model."""
    data = plan.base.model_dump(mode="json")
    sets = {
        **rung_overrides(plan.base, rung),
        "shared.seed": seed,
        "shared.run_name": f"abl-{rung}-s{seed}",
        "shared.model_path": str(plan.out_dir / "models" / f"seed{seed}"),
        "learner.total_steps": plan.steps,
    }
    return build_config(deep_merge(data, cli_overrides(as_sets(sets))))


def make_plan(
    preset: str,
    seeds: int,
    name: str | None = None,
    rungs: Sequence[str] | None = None,
    steps: int | None = None,
    eval_every: int | None = None,
    overrides: Sequence[str] = (),
    root: str = "runs",
    leave_one_out: bool = False,
) -> Plan:
    """Resolve the ablation preset (plus `--set` overrides on the base config)."""
    if preset == "tiny":  # `dapo up --preset tiny` is the max3 demo; no ladder runs on it
        raise DapoError(
            "ablation preset 'tiny' is now 'tiny_runmax' (the ladder runs on the "
            "tiny_runmax config preset; `demo` is `dapo up --preset tiny`'s max3 demo); "
            f"choose: {', '.join(ABLATE_PRESETS)}"
        )
    if preset not in ABLATE_PRESETS:
        raise DapoError(f"unknown ablation preset {preset!r}; choose: {', '.join(ABLATE_PRESETS)}")
    spec = ABLATE_PRESETS[preset]
    sets = [*as_sets(spec["overrides"]), *overrides]
    base = load_config(preset=spec["base"], env={}, overrides=sets)
    chosen = list(rungs or RUNG_NAMES)
    if leave_one_out:  # the ladder's last rung but one is DAPO without dynamic sampling
        same = {"no_dynamic_sampling": "token_level_loss"}
        chosen += [r for r in LOO_NAMES if r not in chosen and same.get(r) not in chosen]
    for rung in chosen:
        rung_overrides(base, rung)  # validates the name
    if seeds < 1:
        raise DapoError("--seeds must be >= 1")
    return Plan(
        name=name or preset,
        base=base,
        rungs=chosen,
        seeds=list(range(seeds)),
        steps=steps or base.learner.total_steps,
        eval_every=eval_every or spec["eval_every"],
        eval_n=spec["eval_n"],
        target=spec["target"],
        root=root,
        overrides=list(overrides),
    )
