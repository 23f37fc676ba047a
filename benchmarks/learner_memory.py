"""Learner memory at long sequence lengths: chunked log-probs against full-vocabulary logits.

One DAPO step (`learner.backends.build_policy` + `learner.step.train_step`, plain torch,
fp32) of a Qwen2-shaped model with the real Qwen2.5 vocabulary (151,936) and a small
body, on one group: a sequence of 256 prompt tokens + a response up to 1k, 4k, 8k and
16k tokens in all, and a second, one-token response (so the advantages are ±0.7, not 0).
Each row runs in its own process: a short warm-up step (it allocates the optimizer
state, so every row holds it at its peak), then the measured steps. Peak RSS
(`ru_maxrss`) is taken after the first measured step, so every row is charged for the
same work; the step time is the fastest measured step. Rows: chunked log-probs
(`logprob_chunk_tokens` 512) with and without activation checkpointing at every length;
the full-logits path (`logprob_chunk_tokens` 0, no checkpointing: the learner before
chunking) at 1k and 4k only, as the baseline (beyond 4k it runs out of memory here).
Each process keeps glibc malloc's defaults, so RSS follows live tensors (blocks over
32 MiB are mapped and returned on free); `--malloc-tuning` applies what `dapo learner`
sets (`services.common.malloc`), under which freed logits chunks stay in the heap and
its high-water mark grows with fragmentation.

Checks:
1. the 16k step completes (chunked, checkpointing on: the default configuration);
2. memory slope: (peak(16k) − peak(4k)) ÷ (12k × V × 4 bytes) ≤ 0.10, i.e. each extra
   token costs under a tenth of one fp32 row of logits;
3. step time at 4k (default configuration) ≤ 1.3 × the full-logits path at 4k, both
   measured in the same run, back to back, twice (the fastest of four steps each).

Writes benchmarks/results/learner_memory.json (details + `checks`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "learner_memory.json"
VOCAB, PROMPT, CHUNK = 151_936, 256, 512
LENGTHS = (1024, 4096, 8192, 16384)
FULL_LENGTHS = (1024, 4096)  # the full path needs ~10 GiB at 4k; never beyond
TARGET_SLOPE, TARGET_TIME = 0.10, 1.3
ROW_TIMEOUT_S = 3600


def build_model(out: Path) -> dict[str, int]:
    """A random Qwen2 with the Qwen2.5 vocabulary: 4 layers, hidden 256, tied head."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=VOCAB, hidden_size=256, intermediate_size=768,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         tie_word_embeddings=True, max_position_embeddings=32768)  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(out)
    total = sum(p.numel() for p in model.parameters())
    return {"parameters": total, "embedding_parameters": VOCAB * config.hidden_size}


def make_group(tokens: int, seed: int = 0) -> Any:
    """One prompt, two responses: `tokens` − 256 tokens (correct) and 1 token (wrong)."""
    import random

    from services.common.types import Group, Sample

    rng = random.Random(seed)
    prompt = [rng.randrange(1, VOCAB) for _ in range(PROMPT)]
    long = [rng.randrange(1, VOCAB) for _ in range(tokens - PROMPT)]
    samples = [
        Sample(long, [-2.0] * len(long), "", "stop", 0, 1.0, True),
        Sample(long[:1], [-2.0], "", "stop", 0, -1.0, False),
    ]
    return Group("g", "p", "", prompt, "", samples=samples)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_row(model_dir: str, tokens: int, chunk: int, checkpointing: bool, reps: int) -> dict:
    """In this process: build the policy, a warm-up step, then `reps` timed steps."""
    from learner.backends import build_policy
    from learner.config import LearnerConfig
    from learner.step import train_step

    cfg = LearnerConfig(
        engine="torch", dtype="float32", lr=1e-6, warmup_steps=0, mini_batch_responses=2,
        micro_batch_tokens=tokens, logprob_chunk_tokens=chunk,
        gradient_checkpointing=checkpointing,
    )  # fmt: skip
    policy = build_policy(model_dir, cfg)
    train_step(policy, [make_group(PROMPT + 256)], cfg, 0, 1.0, tokens)  # optimizer state
    base, seconds, peaks = rss_bytes(), [], []
    for k in range(reps):
        started = time.perf_counter()
        metrics = train_step(policy, [make_group(tokens)], cfg, 0, 1.0, tokens, seed=k)
        seconds.append(time.perf_counter() - started)
        peaks.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # KiB on Linux
        assert metrics.updates == 1 and metrics.grad_norm > 0
    return {"step_s": min(seconds), "steps_s": seconds, "peak_rss_bytes": peaks[0],
            "peak_rss_after_each_step_bytes": peaks, "rss_after_warmup_bytes": base}  # fmt: skip


def row_in_subprocess(model_dir: Path, row: dict, tuned: bool) -> dict:
    """One row in a fresh process (its own peak RSS); a crash or OOM kill is recorded."""
    # As a module from the root: run as a script, `import learner` would find
    # benchmarks/learner.py instead of the package.
    cmd = [sys.executable, "-m", "benchmarks.learner_memory", "--row", str(model_dir),
           str(row["tokens"]), str(row["chunk"]), str(int(row["checkpointing"])),
           str(row["reps"])]  # fmt: skip
    if tuned:
        cmd.append("--malloc-tuning")
    env = dict(os.environ, PYTHONPATH=f"{ROOT}:{ROOT / 'proto'}", DS_ACCELERATOR="cpu")
    started = time.monotonic()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT,
                              timeout=ROW_TIMEOUT_S)  # fmt: skip
    except subprocess.TimeoutExpired:
        return row | {"ok": False, "error": f"timed out after {ROW_TIMEOUT_S} s"}
    wall = round(time.monotonic() - started, 1)
    if proc.returncode != 0:
        return row | {"ok": False, "wall_s": wall, "returncode": proc.returncode,
                      "error": proc.stderr[-2000:]}  # fmt: skip
    return row | {"ok": True, "wall_s": wall} | json.loads(proc.stdout.strip().splitlines()[-1])


def plan_rows() -> list[dict[str, Any]]:
    """Per length: chunked (default), the full path where it fits, chunked without
    checkpointing; the rows timed against each other run back to back."""
    rows = []
    for tokens in LENGTHS:
        reps = 2 if tokens <= 4096 else 1
        row = {"path": "chunked", "tokens": tokens, "chunk": CHUNK, "reps": reps}
        rows.append(row | {"checkpointing": True})
        if tokens in FULL_LENGTHS:
            rows.append(row | {"path": "full_logits", "chunk": 0, "checkpointing": False})
        rows.append(row | {"checkpointing": False, "reps": 1})
    # The timed pair once more at the end: other processes on a shared machine can slow
    # one row down, so the check takes each configuration's fastest step over both.
    pair = [rows[3], rows[4]]
    assert [(r["path"], r["tokens"]) for r in pair] == [("chunked", 4096), ("full_logits", 4096)]
    return rows + [r | {"repeat": True} for r in pair]


def find(rows: list[dict], path: str, tokens: int, checkpointing: bool) -> dict:
    """The first row of that configuration (the memory measurement)."""
    for row in rows:
        if (row["path"], row["tokens"], row["checkpointing"]) == (path, tokens, checkpointing):
            return row
    return {"ok": False}


def fastest(rows: list[dict], path: str, checkpointing: bool) -> float | None:
    """The fastest 4k step of that configuration over all its rows."""
    steps = [t for r in rows if r["ok"] and (r["path"], r["tokens"], r["checkpointing"])
             == (path, 4096, checkpointing) for t in r["steps_s"]]  # fmt: skip
    return min(steps) if steps else None


def slope(rows: list[dict], checkpointing: bool) -> float | None:
    """Peak RSS per extra token from 4k to 16k, in fp32 rows of full-vocabulary logits."""
    a, b = find(rows, "chunked", 4096, checkpointing), find(rows, "chunked", 16384, checkpointing)
    if not (a["ok"] and b["ok"]):
        return None
    return (b["peak_rss_bytes"] - a["peak_rss_bytes"]) / (12288 * VOCAB * 4)


def checks(rows: list[dict]) -> list[dict[str, Any]]:
    def check(name: str, value: Any, target: str, ok: bool) -> dict[str, Any]:
        value = round(value, 4) if isinstance(value, float) else value
        return {"name": name, "value": value, "target": target, "ok": bool(ok)}

    done = find(rows, "chunked", 16384, True)["ok"]
    mem = slope(rows, True)
    new, old = fastest(rows, "chunked", True), fastest(rows, "full_logits", False)
    ratio = new / old if new and old else None
    return [
        check("step_16k_completes", done, "true", done),
        check("memory_slope_4k_to_16k_in_logit_rows", mem, f"<= {TARGET_SLOPE}",
              mem is not None and mem <= TARGET_SLOPE),
        check("step_time_4k_vs_full_logits", ratio, f"<= {TARGET_TIME}",
              ratio is not None and ratio <= TARGET_TIME),
    ]  # fmt: skip


def summary(row: dict) -> str:
    head = f"{row['path']:<11} {row['tokens']:>6} checkpointing={row['checkpointing']!s:<5}"
    if not row["ok"]:
        return f"{head} FAILED"
    return f"{head} peak {row['peak_rss_bytes'] / 2**30:6.2f} GiB  step {row['step_s']:7.1f} s"


def main(argv: list[str] | None = None) -> int:
    """Run every row, write the JSON; 0 when every check is ok."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--row", nargs=5, help=argparse.SUPPRESS)
    parser.add_argument("--malloc-tuning", action="store_true",
                        help="what dapo learner sets instead of glibc's defaults")  # fmt: skip
    args = parser.parse_args(argv if argv is not None else [])
    tuned = args.malloc_tuning
    if args.row:
        from services.common.malloc import keep_freed_memory

        if tuned:
            keep_freed_memory()
        model_dir, tokens, chunk, ckpt, reps = args.row
        print(json.dumps(run_row(model_dir, int(tokens), int(chunk), ckpt == "1", int(reps))))
        return 0
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp))
        for row in plan_rows():
            rows.append(row_in_subprocess(Path(tmp), row, tuned))
            print(summary(rows[-1]), flush=True)
    result = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "load_avg_1m": os.getloadavg()[0]},
        "model": model | {"vocab": VOCAB, "dtype": "float32", "engine": "torch"},
        "prompt_tokens": PROMPT, "logprob_chunk_tokens": CHUNK, "malloc_tuned": tuned,
        "rows": rows, "slope_without_checkpointing": slope(rows, False),
        "checks": checks(rows),
    }  # fmt: skip
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if all(c["ok"] for c in result["checks"]) else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
