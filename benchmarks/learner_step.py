"""Learner benchmarks: training throughput, padding, weight publication.

1. Tokens/s of the learner's DAPO step (`train_step` on a DeepSpeed engine, ZeRO-0,
   fp32, π_old recompute + token-budget micro-batches) against a plain torch loop on the
   same model, batch and optimizer (π_old forward, one padded forward/backward of the
   whole mini-batch, AdamW). Both count real (unpadded) prompt+response tokens.
   Target: ≥ 0.8×.
2. Padding fraction of a length-skewed batch: fixed-size micro-batches in arrival order
   against `token_budget_micro_batches`. Target: ≤ 10 % with the budget.
3. Weight publication: a rollout server's fetch of a ≥ 100 MB random Qwen2 from the
   learner's WeightService on loopback, as `rollout.weights.socket_buckets` runs it (the
   default transport: a ticket over gRPC, the bytes over the weight socket) into a
   `WeightAssembler` up to torch tensors, against raw loopback TCP of the same bytes
   measured in the same run, paired per published version, steady state
   (docs/weight_publication.md). Target: ≥ 0.5×. The FetchWeights gRPC stream (the
   fallback transport) is measured alongside. The publisher (WeightService, weight
   socket and raw TCP sender alike) runs in its own process, as the learner does: in one
   process server and client threads would share one GIL, which no deployment does.
   The code of part 3 is in benchmarks/_weight_publication.py.
   Like `dapo learner` / `dapo rollout`, the process tunes glibc malloc first
   (`--no-malloc-tuning` to compare).

Writes benchmarks/results/learner_step.json (details + `checks`).
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
from benchmarks._results import check, result_path, write_result
from services.common.malloc import keep_freed_memory

RESULTS = result_path("learner_step")


TARGET_SPEEDUP, TARGET_PADDING, TARGET_WIRE = 0.8, 0.10, 0.5


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

    from learner.algorithm import agg_loss, per_token_loss
    from learner.batch import collate, sequences_from_groups
    from learner.batch_plan import mini_batches
    from learner.logprobs import logprobs_for_inputs

    started = time.perf_counter()
    seqs = sequences_from_groups(groups)
    full = collate(seqs, 0)
    with torch.no_grad():
        logits = model(input_ids=full.input_ids, attention_mask=full.attention_mask).logits
        old, _ = logprobs_for_inputs(logits, full.input_ids)
    for mb in mini_batches(len(seqs), cfg.mini_batch_responses, 0):
        x = collate([seqs[i] for i in mb], 0)
        logits = model(input_ids=x.input_ids, attention_mask=x.attention_mask).logits
        lp, _ = logprobs_for_inputs(logits, x.input_ids)
        old_mb = old[mb][:, : x.input_ids.shape[1]]
        loss_mat, _ = per_token_loss(lp, old_mb, x.advantages, x.loss_mask, 0.2, 0.28)
        loss = agg_loss(loss_mat, x.loss_mask, "token_mean", int(x.loss_mask.sum()))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return time.perf_counter() - started


def bench_throughput(root: Path, reps: int) -> dict[str, Any]:
    import torch

    from learner.config import LearnerConfig
    from learner.deepspeed_policy import DeepSpeedPolicy
    from learner.model_io import load_model
    from learner.step import train_step

    model_dir = bench_model_dir(root)
    # Like for like with the plain loop: no activation checkpointing (it recomputes each
    # layer in backward, ~1/3 more compute, a memory trade the small model does not need).
    cfg = LearnerConfig(
        engine="deepspeed",
        zero_stage=0,
        dtype="float32",
        lr=1e-5,
        mini_batch_responses=32,
        micro_batch_tokens=4096,
        gradient_checkpointing=False,
    )
    groups = make_groups(4096, n_groups=8, group_size=8)
    tokens = sum(len(g.prompt_token_ids) + len(s.token_ids) for g in groups for s in g.samples)
    policy = DeepSpeedPolicy(load_model(model_dir), cfg)
    plain = load_model(model_dir)
    opt = torch.optim.AdamW(plain.parameters(), lr=cfg.lr, betas=cfg.betas)
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
def checks(thr: dict, pad: dict, pub: dict) -> list[dict[str, Any]]:
    padding = pad["with_token_budget"]
    megabytes = pub["model_bytes"] / 1e6
    return [
        check(
            "learner_vs_plain_torch_tokens_per_s",
            thr["ratio"],
            f">= {TARGET_SPEEDUP}",
            thr["ratio"] >= TARGET_SPEEDUP,
            digits=4,
        ),
        check(
            "padding_fraction_with_token_budget",
            padding,
            f"<= {TARGET_PADDING}",
            padding <= TARGET_PADDING,
            digits=4,
        ),
        check(
            "publication_vs_raw_tcp_bytes_per_s",
            pub["ratio"],
            f">= {TARGET_WIRE}",
            pub["ratio"] >= TARGET_WIRE,
            digits=4,
        ),
        check(
            "publication_model_megabytes",
            megabytes,
            ">= 100",
            pub["model_bytes"] >= 100e6,
            digits=4,
        ),
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
    pad = bench_padding()
    print(f"padding: {pad}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        thr = bench_throughput(Path(tmp), args.reps)
    print(f"throughput ratio: {thr['ratio']:.3f}", flush=True)
    pub = bench_publication(args.versions, args.bucket_bytes, tuned) | {"malloc_tuned": tuned}
    result = {
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "load_avg_1m": os.getloadavg()[0],
        },
        "throughput": thr,
        "padding": pad,
        "publication": pub,
        "checks": checks(thr, pad, pub),
    }
    return write_result(RESULTS, result)


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
