"""The ablation ladder: each technique is one switch, and each switch changes behaviour.

Every rung differs from the one before it in exactly one switch (paper order). The tests
below take the configs the ladder really runs with and show that flipping each switch
changes what the service that reads it does: the learner's gradient (overlong filtering,
clip-higher, token-level loss), the reward service's reward (soft overlong punishment),
and what the buffer forwards to `train` (dynamic sampling). The last test runs a short
two-rung `dapo ablate` through every process.
"""

from __future__ import annotations

import json
from operator import attrgetter
from pathlib import Path

import pytest
import redis
import torch
from learner_fixtures import make_groups

from learner.batch import sequences_from_groups
from learner.model_io import load_model
from learner.step import accumulate, recompute_old_logprobs
from learner.torch_policy import TorchPolicy
from services.common.adapters import encode_group
from services.common.data import SYNTHETIC_TASKS, synthetic_records
from services.common.errors import DapoError
from services.common.keys import RunKeys
from services.common.reasoning import REASONING_TASKS
from services.common.types import Group, Sample
from services.tools.ablate import mechanism_numbers
from services.tools.ablation_plan import (
    LOO_NAMES,
    RUNG_NAMES,
    TECHNIQUES,
    Plan,
    make_plan,
    run_config,
    rung_overrides,
)
from services.tools.ablation_table import (
    grid_curve,
    plan_info,
    steps_to,
    summarise_rung,
    table_md,
)
from services.tools.config import DapoConfig


@pytest.fixture(scope="module")
def plan() -> Plan:
    return make_plan("tiny_runmax", seeds=1)


def rung(plan: Plan, name: str) -> DapoConfig:
    return run_config(plan, name, seed=0)


def test_each_rung_adds_exactly_one_technique_in_paper_order(plan: Plan) -> None:
    rungs = [rung_overrides(plan.base, name) for name in RUNG_NAMES]
    assert len(rungs) == len(TECHNIQUES) + 1
    for technique, before, after in zip(TECHNIQUES, rungs, rungs[1:], strict=False):
        changed = [path for path in before if before[path] != after[path]]
        assert changed == [technique.path]
    naive, dapo = rung(plan, "naive_grpo"), rung(plan, "dynamic_sampling")
    assert (
        naive.learner.objective.clip_ratio_high == naive.learner.objective.clip_ratio_low
    )  # clip-higher off
    assert naive.learner.objective.loss_agg_mode == "seq_mean_token_mean"
    assert not (naive.buffer.dynamic_sampling or naive.learner.objective.overlong_filtering)
    assert not naive.reward.overlong_punishment
    # The top rung is the base config itself: full DAPO.
    for technique in TECHNIQUES:
        value = attrgetter(technique.path)
        assert value(dapo) == value(plan.base), technique.path
    assert (
        dapo.learner.objective.clip_ratio_high == 0.28
        and dapo.learner.objective.loss_agg_mode == "token_mean"
    )


def test_leave_one_out_turns_off_exactly_one_technique_of_full_dapo(plan: Plan) -> None:
    full = rung_overrides(plan.base, "dynamic_sampling")
    for technique, name in zip(TECHNIQUES, LOO_NAMES, strict=True):
        loo = rung_overrides(plan.base, name)
        assert [p for p in full if full[p] != loo[p]] == [technique.path]
    # Without dynamic sampling is the ladder's "+ token-level loss": run once, shown in both.
    assert rung_overrides(plan.base, "no_dynamic_sampling") == rung_overrides(
        plan.base, "token_level_loss"
    )
    both = make_plan("tiny_runmax", seeds=1, leave_one_out=True).rungs
    assert both == [*RUNG_NAMES, *LOO_NAMES[:-1]]
    alone = make_plan("tiny_runmax", seeds=1, rungs=["dynamic_sampling"], leave_one_out=True).rungs
    assert alone == ["dynamic_sampling", *LOO_NAMES]


def test_runs_differ_by_seed_and_rung_only_where_they_should(plan: Plan) -> None:
    a, b = run_config(plan, "clip_higher", 0), run_config(plan, "clip_higher", 1)
    assert a.shared.seed == 0 and b.shared.seed == 1
    assert a.shared.model_path != b.shared.model_path
    assert a.shared.run_name != run_config(plan, "naive_grpo", 0).shared.run_name
    assert a.learner.total_steps == plan.steps


def test_bad_rung_and_preset_are_named(plan: Plan) -> None:
    with pytest.raises(DapoError, match="unknown rung 'bogus'"):
        make_plan("tiny_runmax", seeds=1, rungs=["naive_grpo", "bogus"])
    with pytest.raises(DapoError, match="unknown ablation preset"):
        make_plan("huge", seeds=1)
    with pytest.raises(DapoError, match="--seeds"):
        make_plan("tiny_runmax", seeds=0)


# --------------------------------------------------------------------------- the task


def test_mixed_task_mixes_difficulty_and_answer_length() -> None:
    train, test = synthetic_records("mixed"), synthetic_records("mixed", split="test")
    assert len(train) == 880 and len(test) == 220
    assert not {r.prompt for r in train} & {r.prompt for r in test}
    assert {len(r.ground_truth) for r in train} == {1, 2}  # max3 and copy2 answers
    assert {r.data_source for r in train} == {"synthetic_max3", "synthetic_copy2"}
    assert "mixed" not in SYNTHETIC_TASKS  # the tiny tokenizer's alphabet is unchanged


def test_mixed_task_budget_truncates_and_punishes() -> None:
    shared = make_plan("tiny_mixed", seeds=1).base.shared
    assert shared.verifier == "first_integer"
    # "7<eos>" (2 tokens) is unpunished; the soft zone starts well before L_max.
    assert 2 <= shared.max_response_length - shared.overlong_buffer_length < 6


def test_ladder_task_is_runmax_with_a_budget_the_reference_fits(plan: Plan) -> None:
    shared = plan.base.shared
    assert plan.base.controller.dataset.synthetic_task == "runmax"
    assert shared.verifier == "dapo"  # the paper's Answer: rule
    # The longest reference (6 steps) is 14 tokens plus <eos>: unpunished, below the soft
    # zone, which itself ends well before a random model's typical length runs out.
    longest = 2 * REASONING_TASKS["runmax"].max_len + 2 + 1
    assert longest <= shared.max_response_length - shared.overlong_buffer_length
    assert shared.overlong_buffer_length > 0


# --------------------------------------------------------------------------- learner


def learner_gradient(model: Path, config: DapoConfig) -> torch.Tensor:
    """The gradient of one mini-batch as the learner computes it under `config`."""
    torch.manual_seed(0)
    policy = TorchPolicy(load_model(model), config.learner)
    groups = make_groups()
    for group in groups:  # some responses hit L_max, with rewards of both signs
        group.samples[-1].truncated = True
        group.samples[-1].finish_reason = "length"
    seqs = sequences_from_groups(groups)
    recompute_old_logprobs(policy, seqs, config.learner, 0, 1.0)
    for s in seqs:  # r = exp(0.1 t): token 2 has r = 1.22, inside (1.2, 1.28]
        s.old_logprobs = s.old_logprobs - 0.1 * torch.arange(len(s.response_ids))
    accumulate(policy, seqs, config.learner, 0, 1.0, config.shared.max_response_length)
    return torch.cat([p.grad.flatten() for p in policy.model.parameters() if p.grad is not None])


@pytest.mark.parametrize(
    ("off", "on"),
    [
        ("naive_grpo", "overlong_filtering"),
        ("overlong_filtering", "clip_higher"),
        ("soft_overlong", "token_level_loss"),
    ],
)
def test_learner_switch_changes_the_gradient(plan: Plan, tiny_model: Path, off, on) -> None:
    before = learner_gradient(tiny_model, rung(plan, off))
    after = learner_gradient(tiny_model, rung(plan, on))
    assert before.abs().sum() > 0
    assert not torch.allclose(before, after, rtol=1e-4, atol=1e-7)


def test_reward_side_switch_leaves_the_gradient_alone(plan: Plan, tiny_model: Path) -> None:
    # The control for the test above: soft punishment is applied by the reward service.
    a = learner_gradient(tiny_model, rung(plan, "clip_higher"))
    b = learner_gradient(tiny_model, rung(plan, "soft_overlong"))
    assert torch.equal(a, b)


def test_clip_higher_switch_is_the_upper_bound_only(plan: Plan) -> None:
    off, on = rung(plan, "overlong_filtering").learner, rung(plan, "clip_higher").learner
    assert off.objective.clip_ratio_low == on.objective.clip_ratio_low == 0.2
    assert (off.objective.clip_ratio_high, on.objective.clip_ratio_high) == (0.2, 0.28)


# --------------------------------------------------------------------------- reward


def test_soft_overlong_switch_changes_the_reward(plan: Plan) -> None:
    from reward.scoring import ScoreInput
    from reward.server import create_scorer

    rewards = {}
    for name in ("clip_higher", "soft_overlong"):
        config = rung(plan, name)
        config.reward.num_workers = 1
        scorer = create_scorer(config)
        try:
            items = [
                ScoreInput(text, "7", verifier="dapo", response_length=n)
                for text, n in (("7,7,7,7,7,7\nAnswer: 7", 18), ("Answer: 7", 3))
            ]
            rewards[name] = [o.reward for o in scorer.score(items)]
        finally:
            scorer.pool.close()
    # L_max 20, L_cache 4: a correct 18-token response loses (18 - 16) / 4 of its reward.
    assert rewards["clip_higher"] == [1.0, 1.0]
    assert rewards["soft_overlong"] == pytest.approx([1.0 - 2 / 4, 1.0])


# --------------------------------------------------------------------------- buffer


def scored_group(group_id: str, correct: list[bool]) -> Group:
    samples = [Sample([1, 2], [-0.1, -0.2], "x", "stop", 0, 1.0 if c else -1.0, c) for c in correct]
    return Group(group_id, group_id, "1,2,3=", [5], "3", samples=samples)


def test_dynamic_sampling_switch_changes_what_is_trained(
    plan: Plan, redis_client: redis.Redis, redis_server
) -> None:
    from services.buffer.server import Buffer

    g = plan.base.shared.group_size
    groups = [
        scored_group("all-right", [True] * g),
        scored_group("all-wrong", [False] * g),
        scored_group("mixed", [True] + [False] * (g - 1)),
    ]
    forwarded = {}
    for name in ("token_level_loss", "dynamic_sampling"):
        config = rung(plan, name)
        config.shared.redis_url = redis_server.url
        keys = RunKeys(config.shared.run_name)
        for group in groups:
            redis_client.xadd(keys.scored, {"group": encode_group(group)})
        buffer = Buffer(config, redis_client)
        buffer.handle(buffer.consumer.read(10))
        forwarded[name] = redis_client.xlen(keys.train)
        assert not redis_client.exists(keys.pass_rates)  # a pure filter: the controller
        # records pass rates when it publishes
    assert forwarded == {"token_level_loss": 3, "dynamic_sampling": 1}


# --------------------------------------------------------------------------- summary


def test_grid_curve_interpolates_between_evaluated_versions() -> None:
    points = [(0, 0.0), (4, 0.4), (11, 0.6)]
    assert grid_curve(points, [0, 2, 4, 10, 12]) == pytest.approx(
        [0.0, 0.2, 0.4, 0.6 - 0.2 / 7, 0.6]
    )
    assert steps_to(points, 0.5) == 11 and steps_to(points, 0.9) is None


def test_summary_is_mean_and_spread_over_seeds(plan: Plan) -> None:
    small = Plan(
        plan.name, plan.base, ["naive_grpo"], [0, 1], steps=10, eval_every=5, eval_n=4, target=0.5
    )
    rows = [
        {
            "rung": "naive_grpo",
            "curve": [(0, 0.0), (5, 0.5), (10, 0.6)],
            "generated_per_trained": 1.0,
            "entropy_end": 2.0,
            "train_s": 10.0,
            "wall_s": 20.0,
        },
        {
            "rung": "naive_grpo",
            "curve": [(0, 0.0), (5, 0.2), (10, 0.4)],
            "generated_per_trained": 1.2,
            "entropy_end": 1.0,
            "train_s": 12.0,
            "wall_s": 22.0,
        },
    ]
    s = summarise_rung(plan_info(small), rows)
    assert s["grid"] == [0, 5, 10]
    assert s["acc_mean"] == pytest.approx([0.0, 0.35, 0.5])
    assert s["acc_min"] == pytest.approx([0.0, 0.2, 0.4])
    assert s["final_acc"][0] == pytest.approx(0.5)
    assert s["steps_to_target"] == [5, None] and s["reached"] == 1
    assert s["generated_per_trained"][0] == pytest.approx(1.1)


def test_mechanism_numbers_compare_the_first_and_last_tenth() -> None:
    steps = [
        {
            "truncated_frac": 0.5 if i < 2 else 0.0,
            "response_length": 12.0 - i / 2,
            "response_length_max": 20 - i // 2,
            "entropy": 2.0 - i / 10,
        }
        for i in range(20)
    ]
    m = mechanism_numbers(steps)
    assert (m["truncated_start"], m["truncated_end"]) == (0.5, 0.0)
    assert (m["length_start"], m["length_end"]) == (pytest.approx(11.75), pytest.approx(2.75))
    assert m["length_max_end"] == 11 and m["entropy_start"] == pytest.approx(1.95)
    assert m["long_share_end"] is None and m["full_informative"] is None  # older reports
    later = [
        {"longest_loss_share": 0.4 - i / 100, "informative_frac": 1.0 - (i % 4) / 8}
        for i in range(20)
    ]
    m = mechanism_numbers(later)
    assert (m["long_share_start"], m["long_share_end"]) == pytest.approx((0.395, 0.215))
    assert m["full_informative"] == 0.25  # every 4th step had only informative groups
    # A report written before the metrics existed has none of them.
    assert mechanism_numbers([{"entropy": 1.0}])["truncated_end"] is None


def test_table_shows_the_mechanism_columns(plan: Plan) -> None:
    small = Plan(
        plan.name, plan.base, ["naive_grpo"], [0], steps=10, eval_every=5, eval_n=4, target=0.5
    )
    row = {
        "rung": "naive_grpo",
        "curve": [(0, 0.0), (10, 0.6)],
        "generated_per_trained": 1.0,
        "entropy_end": 0.5,
        "train_s": 10.0,
        "wall_s": 20.0,
        **mechanism_numbers(
            [
                {
                    "truncated_frac": 0.3,
                    "response_length": 14.0,
                    "response_length_max": 20,
                    "entropy": 2.5,
                }
            ]
        ),
    }
    info = plan_info(small)
    text = table_md(info, [summarise_rung(info, [row])], {"loadavg": "1", "total_s": 60})
    assert "| 0.30 → 0.30 | 14.0 → 14.0 (20.0) | — → — |" in text
    assert "| 2.50 → 0.50 |" in text
    assert "| 10 (1/1) / — |" in text and "Leave-one-out" not in text  # 0.5 at 10, never 0.8


def test_leave_one_out_table_reuses_the_ladder_rung_with_the_same_config(plan: Plan) -> None:
    rungs = ["token_level_loss", "dynamic_sampling", "no_clip_higher"]
    small = Plan(plan.name, plan.base, rungs, [0, 1], steps=10, eval_every=5, eval_n=4, target=0.5)
    info = plan_info(small)
    rows = [
        {
            "rung": r,
            "seed": k,
            "curve": [(0, 0.1), (5, 0.6 + k / 10), (10, 0.9)],
            "generated_per_trained": 2.0,
            "entropy_end": 0.5,
            "train_s": 10.0,
            "wall_s": 20.0,
            **mechanism_numbers([{"informative_frac": 1.0}]),
        }
        for r in rungs
        for k in (0, 1)
    ]
    summary = [summarise_rung(info, [r for r in rows if r["rung"] == name]) for name in rungs]
    ladder, loo = table_md(info, summary, {"loadavg": "1", "total_s": 60}).split("Leave-one-out")
    assert "DAPO without" not in ladder and "| + token-level loss |" in ladder
    labels = [line.split(" | ")[0] for line in loo.splitlines() if line.startswith("| ")][1:]
    assert labels == [
        "| + dynamic sampling (= DAPO)",
        "| DAPO without clip-higher",
        "| DAPO without dynamic sampling (= + token-level loss)",
    ]
    assert "| 5 (2/2) / 10 (2/2) | 2.00 | 1.00 |" in loo


# --------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_dapo_ablate_two_rungs_one_seed(tmp_path: Path) -> None:
    from services.tools.cli import main

    code = main(
        [
            "ablate",
            "--seeds",
            "1",
            "--rungs",
            "naive_grpo,dynamic_sampling",
            "--steps",
            "3",
            "--eval-every",
            "2",
            "--name",
            "t",
            "--out-root",
            str(tmp_path),
        ]
    )
    assert code == 0
    out = tmp_path / "ablate-t"
    table = json.loads((out / "table.json").read_text())
    runs = {r["rung"]: r for r in table["runs"]}
    assert set(runs) == {"naive_grpo", "dynamic_sampling"}
    for run in runs.values():
        assert run["steps"] == 3 and run["ledger_ok"]
        assert [v for v, _ in run["curve"]][0] == 0 and run["curve"][-1][0] == 3
    # Dynamic sampling off forwards every group; on, the (mostly all-wrong) early groups go.
    assert runs["naive_grpo"]["filtered"] == 0
    assert runs["dynamic_sampling"]["filtered"] > 0
    assert "naive GRPO" in (out / "table.md").read_text()
    assert (out / "accuracy.png").read_bytes()[:4] == b"\x89PNG"
