"""Named configurations. `paper` is the defaults (the DAPO paper's hyperparameters);
`tiny` trains full DAPO on this CPU on the `runmax` reasoning task; `tiny_max3` is the
earlier demo (one-digit answers, first-integer verifier, no length techniques); `long`
is `tiny_max3` with 2k-token responses, to see the system's per-group costs beside long
generations on a CPU.

The files in examples/ are these presets written out; a test keeps them equal.
"""

from __future__ import annotations

from typing import Any

PAPER: dict[str, Any] = {}

# A random 2-layer Qwen2 learns "largest of three digits" from scratch on 2 CPU cores in
# about a minute with these settings (measured: docs/ablation.md, README's demo timing).
TINY_MAX3: dict[str, Any] = {
    "shared": {
        "run_name": "tiny_max3",
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
        "dataset": {"kind": "synthetic", "synthetic_task": "max3"},
        "eval": {"n": 4},
        "apply_chat_template": False,
        "max_groups_in_flight": 64,
    },
    "rollout": {"engine": {"kind": "torch", "device": "cpu", "dtype": "float32"}},
    "reward": {"num_workers": 1, "overlong_punishment": False},
    "learner": {
        "lr": 1e-3,
        "betas": [0.9, 0.99],
        "warmup_steps": 0,
        "weight_decay": 0.0,
        "mini_batch_responses": 128,
        "micro_batch_tokens": 4096,
        "overlong_filtering": False,
        "total_steps": 100,
        "zero_stage": 0,
        "dtype": "float32",
        "checkpoint_every": 20,
        "gradient_checkpointing": False,
    },
}

# Full DAPO on `runmax` (2-6 running-max steps, then `Answer: x`, the `dapo` rule): the
# reference response is 6-14 tokens, L_max 20 with a 4-token soft zone, so a random model
# is truncated ~30% of the time (docs/tasks.md); overlong filtering and soft punishment on.
TINY: dict[str, Any] = {
    "shared": {
        **TINY_MAX3["shared"],
        "run_name": "tiny",
        "max_response_length": 20,
        "overlong_buffer_length": 4,
        "verifier": "dapo",
    },
    "controller": {
        **TINY_MAX3["controller"],
        "dataset": {"kind": "synthetic", "synthetic_task": "runmax"},
    },
    "rollout": TINY_MAX3["rollout"],
    "reward": {**TINY_MAX3["reward"], "overlong_punishment": True},
    # Four updates per step instead of two: 0.85 held-out at step 100 against 0.77
    # (docs/tasks.md); lr 2e-3 instead was unstable (0.31).
    "learner": {**TINY_MAX3["learner"], "overlong_filtering": True, "mini_batch_responses": 64},
}

# The tiny model (16-token vocabulary) with 2048-token responses: the `tiny_long` model
# names no EOS, so every response runs to the limit. Overlong filtering stays off (as in
# `tiny`), otherwise truncated responses would leave nothing to train. Packed
# micro-batches of 8192 tokens hold three such sequences. Few, small steps: it is for
# measuring (its report's `time_accounting`), not for learning.
LONG: dict[str, Any] = {
    "shared": {
        **TINY_MAX3["shared"],
        "run_name": "long",
        "model_path": "runs/models/tiny_long",
        "model_init": "tiny_long",
        "group_size": 4,
        "max_response_length": 2048,
        "train_batch_groups": 2,
        "max_staleness": 0,
    },
    # No held-out evaluation: 200 prompts × 4 samples × 2048 tokens would dwarf the run.
    "controller": {
        **TINY_MAX3["controller"],
        "eval": {"enabled": False},
        "max_groups_in_flight": 4,
    },
    "rollout": TINY_MAX3["rollout"],
    "reward": TINY_MAX3["reward"],
    "learner": {
        **TINY_MAX3["learner"],
        "mini_batch_responses": 8,
        "micro_batch_tokens": 8192,
        "total_steps": 4,
        "checkpoint_every": 4,
    },
}

PRESETS: dict[str, dict[str, Any]] = {
    "paper": PAPER,
    "tiny": TINY,
    "tiny_max3": TINY_MAX3,
    "long": LONG,
}
