"""A plain single-process DAPO loop: the baseline the service system is measured against.

Same model, task, verifier, filter, loss and optimiser as `dapo up` (it calls the
project's own functions), but generation, scoring and training run one after another
in one process with no gRPC, no Redis and no other services.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from learner.model_io import load_model
from learner.step import train_step
from learner.torch_policy import TorchPolicy
from reward.verifiers import run_verifier
from rollout.engine import SamplingParams
from rollout.torch_engine import TorchEngine
from services.buffer.filters import check_informative
from services.common.data import synthetic_records
from services.common.types import Group, Sample
from services.controller.dataset import Cursor, iterate
from services.tools.config import DapoConfig
from services.tools.evaluate import prompt_ids, summarise


@dataclass
class PlainResult:
    steps: int = 0
    responses: int = 0
    groups_generated: int = 0
    groups_trained: int = 0
    gen_seconds: float = 0.0
    train_seconds: float = 0.0
    wall_seconds: float = 0.0
    eval_seconds: float = 0.0
    curve: list[dict[str, float]] = field(default_factory=list)


def score_group(engine: TorchEngine, record: Any, outs: list, verifier: str) -> Group:
    samples = []
    for o in outs:
        text = engine.tokenizer.decode(o.token_ids, skip_special_tokens=True)
        verdict = run_verifier(verifier, text, record.ground_truth)
        samples.append(
            Sample(
                o.token_ids,
                o.logprobs,
                text,
                o.finish_reason,
                o.policy_version,
                reward=1.0 if verdict.correct else -1.0,
                correct=verdict.correct,
                truncated=o.finish_reason == "length",
            )
        )
    return Group(
        record.prompt_id,
        record.prompt_id,
        record.prompt,
        prompt_ids(engine.tokenizer, record.prompt, False),
        record.ground_truth,
        samples=samples,
    )


def held_out_accuracy(engine: TorchEngine, cfg: DapoConfig, n: int = 4) -> float:
    records = synthetic_records(cfg.controller.dataset.synthetic_task, split="test")
    params = SamplingParams(
        n=n, temperature=1.0, top_p=0.7, max_tokens=cfg.shared.max_response_length
    )
    outs = engine.generate([prompt_ids(engine.tokenizer, r.prompt, False) for r in records], params)
    correct = [
        [
            run_verifier(
                cfg.shared.verifier,
                engine.tokenizer.decode(o.token_ids, skip_special_tokens=True),
                r.ground_truth,
            ).correct
            for o in row
        ]
        for r, row in zip(records, outs, strict=True)
    ]
    return summarise(correct, n)[f"avg@{n}"]


def run_plain(cfg: DapoConfig, steps: int, eval_every: int = 0) -> PlainResult:
    """Train for `steps` steps; optionally record held-out accuracy every `eval_every`."""
    engine = TorchEngine(cfg.model_path, dtype="float32")
    policy = TorchPolicy(load_model(cfg.model_path), cfg.learner)
    data = cfg.controller.dataset
    records = synthetic_records(data.synthetic_task, seed=cfg.shared.seed)
    # the controller's own prompt stream: epochs, shuffles and answer-balanced draws alike
    stream = iterate(records, Cursor(), cfg.shared.seed, data.shuffle, data.answer_balance)
    params = SamplingParams(
        n=cfg.shared.group_size, temperature=1.0, max_tokens=cfg.shared.max_response_length
    )
    need, result = cfg.shared.train_batch_groups, PlainResult()
    pad = engine.pad_token_id
    started = time.perf_counter()
    carry: list[Group] = []
    while result.steps < steps:
        t0 = time.perf_counter()
        while len(carry) < need:
            batch = [next(stream)[1] for _ in range(need)]
            outs = engine.generate(
                [prompt_ids(engine.tokenizer, r.prompt, False) for r in batch], params
            )
            groups = [
                score_group(engine, r, o, cfg.shared.verifier)
                for r, o in zip(batch, outs, strict=True)
            ]
            result.groups_generated += len(groups)
            result.responses += len(groups) * cfg.shared.group_size
            carry += [g for g in groups if check_informative(g, "acc").keep]
        t1 = time.perf_counter()
        train_step(policy, carry[:need], cfg.learner, pad, 1.0, cfg.shared.max_response_length)
        policy.advance_schedule()
        carry = carry[need:]
        with torch.no_grad():
            engine.load_weights(policy.model.state_dict().items(), result.steps + 1)
        result.steps += 1
        result.groups_trained += need
        result.gen_seconds += t1 - t0
        result.train_seconds += time.perf_counter() - t1
        if eval_every and result.steps % eval_every == 0:
            # `seconds`: when the step evaluated was done (the evaluations before it in).
            done, acc = time.perf_counter() - started, held_out_accuracy(engine, cfg)
            result.eval_seconds += time.perf_counter() - started - done
            result.curve.append({"step": result.steps, "seconds": done, "held_out": acc})
    result.wall_seconds = time.perf_counter() - started
    return result


if __name__ == "__main__":
    import json
    import sys

    from services.tools.config import load_config

    torch.set_num_threads(1)
    config = load_config(preset="tiny", env={}, overrides=sys.argv[2:])
    out = run_plain(config, int(sys.argv[1]), eval_every=10)
    print(json.dumps(out.__dict__, indent=1))
