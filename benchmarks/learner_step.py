"""Learner benchmarks: training throughput, padding, weight publication.

1. Tokens/s of the learner's DAPO step against a plain torch loop on the same model,
   batch and optimizer (≥ 0.8×); 1b. CPU seconds of the tiny preset's step against the
   plain padded torch step (≤ 1.2×); 2. padding fraction of a length-skewed batch with token
   budget micro-batches (≤ 10 %); 3. a rollout server's fetch of a ≥ 100 MB model over the
   weight socket against raw loopback TCP of the same bytes (≥ 0.5×; code in
   benchmarks/_weight_publication.py). Writes benchmarks/results/learner_step.json.
   Method: benchmarks/README.md, "`learner_step`".
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import _weight_publication
from benchmarks._results import at_least, at_most, result_path, write_result
from services.common.malloc import keep_freed_memory

RESULTS = result_path("learner_step")


TARGET_SPEEDUP, TARGET_PADDING, TARGET_WIRE = 0.8, 0.10, 0.5
TARGET_TINY_CPU = 1.2  # the tiny preset's step CPU ÷ a plain padded torch step (issue 37)


def skewed_lengths(n: int, seed: int = 0) -> list[tuple[int, int]]:
    """(prompt, response) lengths: most responses short, a long tail (as in RL on math)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        long_tail = rng.random() < 0.2
        response = rng.randint(160, 256) if long_tail else rng.randint(8, 64)
        out.append((rng.randint(16, 48), response))
    return out


def make_groups(vocab: int, n_groups: int, group_size: int, seed: int = 0) -> list[Any]:
    from services.common.types import Group, Sample

    rng = random.Random(seed)
    lengths = iter(skewed_lengths(n_groups * group_size, seed))
    groups = []
    for g in range(n_groups):
        samples, prompt_len = [], 0
        for k in range(group_size):
            prompt_len, response = next(lengths) if k == 0 else (prompt_len, next(lengths)[1])
            tokens = [rng.randrange(1, vocab) for _ in range(response)]
            samples.append(
                Sample(tokens, [-2.0] * response, "", "stop", 0, float(k % 2), k % 2 == 1)
            )
        prompt = [rng.randrange(1, vocab) for _ in range(prompt_len)]
        groups.append(Group(f"g{g}", f"p{g}", "", prompt, "", samples=samples))
    return groups


# ------------------------------------------------------------------ 1. throughput
def bench_model_dir(root: Path) -> Path:
    """A Qwen2 of ~7M parameters with the tiny preset's tokenizer files."""
    from dataclasses import replace

    from benchmarks._models import BENCH_SHAPE, random_qwen2
    from learner.init_model import init_model

    out = init_model(root / "bench", preset="tiny", seed=0)
    shape = replace(BENCH_SHAPE, max_position_embeddings=1024)
    random_qwen2(4096, shape, seed=0).save_pretrained(out)
    return out


def plain_torch_step(model: Any, opt: Any, groups: list[Any], cfg: Any) -> float:
    """The baseline: π_old forward, then per mini-batch one padded forward/backward + AdamW."""
    import torch

    from learner.algorithm import agg_loss, policy_loss
    from learner.batch import collate, sequences_from_groups
    from learner.batch_plan import mini_batches
    from learner.logprobs import logprobs_for_inputs

    started = time.perf_counter()
    seqs = sequences_from_groups(groups)
    full = collate(seqs, 0)
    with torch.no_grad():
        logits = model(input_ids=full.input_ids, attention_mask=full.attention_mask).logits
        old, _ = logprobs_for_inputs(logits, full.input_ids)
    for mb in mini_batches(len(seqs), cfg.batching.mini_batch_responses, 0):
        x = collate([seqs[i] for i in mb], 0)
        logits = model(input_ids=x.input_ids, attention_mask=x.attention_mask).logits
        lp, _ = logprobs_for_inputs(logits, x.input_ids)
        old_mb = old[mb][:, : x.input_ids.shape[1]]
        loss_mat, _ = policy_loss(lp, old_mb, x.advantages, x.loss_mask, 0.2, 0.28)
        loss = agg_loss(loss_mat, x.loss_mask, "token_mean", int(x.loss_mask.sum()))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optimizer.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return time.perf_counter() - started


def bench_throughput(root: Path, reps: int) -> dict[str, Any]:
    import torch

    from learner.config import BatchingConfig, DeepSpeedConfig, LearnerConfig, OptimizerConfig
    from learner.deepspeed_policy import DeepSpeedPolicy
    from learner.model_io import load_model
    from learner.step import train_step

    model_dir = bench_model_dir(root)
    # Like for like with the plain loop: no activation checkpointing (it recomputes each
    # layer in backward, ~1/3 more compute, a memory trade the small model does not need).
    cfg = LearnerConfig(
        engine="deepspeed",
        dtype="float32",
        deepspeed=DeepSpeedConfig(zero_stage=0),
        optimizer=OptimizerConfig(lr=1e-5),
        batching=BatchingConfig(
            mini_batch_responses=32, micro_batch_tokens=4096, gradient_checkpointing=False
        ),
    )
    groups = make_groups(4096, n_groups=8, group_size=8)
    tokens = sum(len(g.prompt_token_ids) + len(s.token_ids) for g in groups for s in g.samples)
    policy = DeepSpeedPolicy(load_model(model_dir), cfg)
    plain = load_model(model_dir)
    opt = torch.optim.AdamW(plain.parameters(), lr=cfg.optimizer.lr, betas=cfg.optimizer.betas)
    learner_s, plain_s = [], []
    for rep in range(reps + 1):  # the first of each is a warm-up
        a = train_step(policy, groups, cfg, 0, 1.0, 256, seed=0).seconds
        b = plain_torch_step(plain, opt, groups, cfg)
        if rep:
            learner_s.append(a)
            plain_s.append(b)
    learner_tps, plain_tps = (
        tokens / statistics.median(learner_s),
        tokens / statistics.median(plain_s),
    )
    return {
        "model": "Qwen2 4 layers, hidden 256, vocab 4096 (random)",
        "batch": {"groups": 8, "responses": 64, "real_tokens": tokens, "mini_batches": 2},
        "learner": {
            "engine": "deepspeed zero0 fp32, chunked log-probs, no checkpointing",
            "tokens_per_s": learner_tps,
            "seconds": learner_s,
        },
        "plain_torch": {"tokens_per_s": plain_tps, "seconds": plain_s},
        "ratio": learner_tps / plain_tps,
    }


# ------------------------------------------------------------------ 1b. the tiny step
def tiny_groups(vocab: int, eos: int, seed: int = 0) -> list[Any]:
    """The tiny preset's batch: 16 groups of 16, `d,d,d=` prompts (6 tokens), 1-4 tokens
    answers (most end on EOS), half of each group rewarded."""
    from services.common.types import Group, Sample, logprob_array, token_array

    rng = random.Random(seed)
    groups = []
    for g in range(16):
        prompt = [rng.randrange(3, vocab) for _ in range(6)]
        samples = []
        for k in range(16):
            n = rng.randint(1, 4)
            tokens = [rng.randrange(3, vocab) for _ in range(n - 1)] + [eos]
            logprobs = logprob_array([-2.0] * n)
            sample = Sample(token_array(tokens), logprobs, "", "stop", 0, float(k % 2), k % 2 == 1)
            samples.append(sample)
        groups.append(Group(f"g{g}", f"p{g}", "", prompt, "", samples=samples))
    return groups


def bench_tiny_step(root: Path, reps: int) -> dict[str, Any]:
    """CPU seconds of the tiny preset's learner step (its config, model and batch shape,
    one torch thread as the preset) against the plain padded torch step, interleaved."""
    import torch

    from learner.config import LearnerConfig
    from learner.deepspeed_policy import DeepSpeedPolicy
    from learner.init_model import init_model
    from learner.model_io import load_model
    from learner.old_logprobs import OldLogprobGate
    from learner.step import train_step
    from services.common.presets import TINY

    model_dir = init_model(root / "tiny", preset="tiny", seed=0)
    variants = {
        "packed": LearnerConfig(**TINY["learner"]),
        "padded": LearnerConfig(
            **{**TINY["learner"], "batching": {**TINY["learner"]["batching"], "packing": False}}
        ),
    }
    threads = torch.get_num_threads()
    torch.set_num_threads(int(TINY["shared"]["torch_threads"]))
    try:
        policies = {k: DeepSpeedPolicy(load_model(model_dir), c) for k, c in variants.items()}
        plain = load_model(model_dir)
        cfg = variants["packed"]
        opt = torch.optim.AdamW(plain.parameters(), lr=cfg.optimizer.lr, betas=cfg.optimizer.betas)
        vocab = int(plain.config.vocab_size)
        groups = tiny_groups(vocab, eos=1)
        # Informative only: the step with π_old taken from the engine (`old_logprobs: auto`
        # once it measured no gap; the gate is told so, the batch's log-probs are stand-ins).
        policies["packed_reusing_pi_old"] = DeepSpeedPolicy(load_model(model_dir), cfg)
        variants["packed_reusing_pi_old"] = cfg
        cpu: dict[str, list[float]] = {k: [] for k in (*variants, "plain_torch")}
        for rep in range(reps + 1):  # the first of each is a warm-up
            for name, policy in policies.items():
                gate = OldLogprobGate.from_config(cfg.objective) if "reusing" in name else None
                if gate is not None:
                    gate.record(0.0)
                started = time.process_time()
                train_step(policy, groups, variants[name], 0, 1.0, 4, seed=rep, old_logprobs=gate)
                if rep:
                    cpu[name].append(time.process_time() - started)
            started = time.process_time()
            plain_torch_step(plain, opt, groups, cfg)
            if rep:
                cpu["plain_torch"].append(time.process_time() - started)
    finally:
        torch.set_num_threads(threads)
    median = {k: statistics.median(v) for k, v in cpu.items()}
    return {
        "model": "the tiny preset's (init_model tiny): Qwen2 2 layers, hidden 64",
        "batch": {
            "groups": 16,
            "responses": 256,
            "mini_batches": 256 // cfg.batching.mini_batch_responses,
            "prompt_tokens": 6,
        },
        "torch_threads": int(TINY["shared"]["torch_threads"]),
        "cpu_seconds": cpu,
        "median_cpu_seconds": median,
        "ratio": median["packed"] / median["plain_torch"],
        "padded_ratio": median["padded"] / median["plain_torch"],
        "reusing_pi_old_ratio": median["packed_reusing_pi_old"] / median["plain_torch"],
    }


# ------------------------------------------------------------------ 2. padding
def bench_padding() -> dict[str, Any]:
    from learner.batch_plan import fixed_size_micro_batches, padding_fraction
    from learner.batch_plan import token_budget_micro_batches as budgeted

    lengths = [p + r for p, r in skewed_lengths(512, seed=1)]
    fixed = padding_fraction(lengths, fixed_size_micro_batches(len(lengths), 16))
    by_budget = {b: padding_fraction(lengths, budgeted(lengths, b)) for b in (2048, 4096, 8192)}
    budget = 4096  # the tiny preset's micro_batch_tokens
    return {
        "rows": len(lengths),
        "fixed_16_rows": fixed,
        "token_budget": budget,
        "with_token_budget": by_budget[budget],
        "by_budget": by_budget,
    }


# ------------------------------------------------------------------ main
def checks(thr: dict, tiny: dict, pad: dict, pub: dict) -> list[dict[str, Any]]:
    return [
        at_least("learner_vs_plain_torch_tokens_per_s", thr["ratio"], TARGET_SPEEDUP, 4),
        at_most("tiny_step_cpu_vs_plain_torch", tiny["ratio"], TARGET_TINY_CPU, 4),
        at_most("padding_fraction_with_token_budget", pad["with_token_budget"], TARGET_PADDING, 4),
        at_least("publication_vs_raw_tcp_bytes_per_s", pub["ratio"], TARGET_WIRE, 4),
        at_least("publication_model_megabytes", pub["model_bytes"] / 1e6, 100, 4),
    ]


def main(argv: list[str] | None = None) -> int:
    """Run the three benchmarks, write the JSON; 0 when every check is ok."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument(
        "--versions", type=int, default=8, help="weight versions published (1st: cold)"
    )
    parser.add_argument(
        "--publication-only",
        action="store_true",
        help="only benchmark 3; print it, leave the results file alone",
    )
    parser.add_argument("--bucket-bytes", type=int, help="default: the learner's config")
    parser.add_argument(
        "--no-malloc-tuning",
        action="store_true",
        help="glibc defaults instead of what learner and rollout set",
    )
    args = parser.parse_args(argv if argv is not None else [])
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    tuned = not args.no_malloc_tuning and keep_freed_memory()
    bench_publication = _weight_publication.bench_publication
    if args.publication_only:
        pub = bench_publication(args.versions, args.bucket_bytes, tuned) | {"malloc_tuned": tuned}
        print(json.dumps(pub, indent=2), f"\nload average {os.getloadavg()}")
        return 0 if pub["ratio"] >= TARGET_WIRE else 1
    load_at_start = os.getloadavg()[0]  # the machine is shared: say how busy it was
    pad = bench_padding()
    print(f"padding: {pad}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        thr = bench_throughput(Path(tmp), args.reps)
    print(f"throughput ratio: {thr['ratio']:.3f}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        tiny = bench_tiny_step(Path(tmp), max(args.reps, 5))
    print(f"tiny step CPU ratio: {tiny['ratio']:.3f}", flush=True)
    pub = bench_publication(args.versions, args.bucket_bytes, tuned) | {"malloc_tuned": tuned}
    result = {
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "load_avg_1m_at_start": load_at_start,
            "load_avg_1m": os.getloadavg()[0],
        },
        "throughput": thr,
        "tiny_step": tiny,
        "padding": pad,
        "publication": pub,
        "checks": checks(thr, tiny, pad, pub),
    }
    return write_result(RESULTS, result)


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
