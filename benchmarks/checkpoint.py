"""Checkpoint benchmarks: the time to write one, and training beside a background write.

1. Seconds to write a checkpoint through `Trainer.checkpoint` (host copy, then files
   fsynced, then `latest`) of the tiny preset's model and of a ~0.18B model with
   Qwen2.5-0.5B's layer shape (12 of its 24 layers, vocabulary 4096: the 0.5B's ~6 GB fp32
   + Adam state, copied, does not fit this shared machine), DeepSpeed ZeRO-0 fp32 on CPU;
   the write rate in MB/s. 2. The learner step's time with no write (before and after)
   ÷ while a background checkpoint of that model is written (≥ 0.9). Writes
   benchmarks/results/checkpoint.json. Method: benchmarks/README.md, "`checkpoint`".
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._results import at_least, machine, result_path, write_result
from learner.init_model import ModelShape, init_model
from services.common.process import configure_process

RESULTS = result_path("checkpoint")
TARGET_STEP_RATIO = 0.9
# Qwen2.5-0.5B's layers (hidden 896, FFN 4864, 14 heads / 2 KV), half as many of them.
HALF_05B = ModelShape(896, 4864, 12, 14, 2, 1024, True)


def model_dir(root: Path, name: str) -> Path:
    """The tiny preset's model, or ("half-0.5b") the 0.5B-shaped one with its tokenizer."""
    from benchmarks._models import random_qwen2

    out = init_model(root / name, preset="tiny", seed=0)
    if name == "half-0.5b":
        random_qwen2(4096, HALF_05B, seed=0).save_pretrained(out)
    return out


def trainer_for(model: Path, checkpoints: Path) -> Any:
    """The learner's `Trainer` (what every rank holds) as `dapo learner` builds it."""
    from learner.trainer import Trainer
    from services.tools.config import load_config

    sets = {
        "shared.run_name": "bench",
        "shared.model_path": model,
        "shared.max_response_length": 16,
        "shared.overlong_buffer_length": 0,
        "learner.engine": "deepspeed",
        "learner.dtype": "float32",
        "learner.deepspeed.zero_stage": 0,
        "learner.batching.mini_batch_responses": 4,
        "learner.batching.gradient_checkpointing": "false",
        "learner.checkpoint.dir": checkpoints,
    }
    return Trainer(load_config(None, overrides=[f"{k}={v}" for k, v in sets.items()]))


def groups(vocab: int) -> list[Any]:
    """One group of 4 responses of 16 tokens after a 16-token prompt (a short step)."""
    import numpy as np

    from services.common.types import Group, Sample

    ids = np.arange(16) % (vocab - 1) + 1
    samples = [
        Sample(ids, np.full(16, -2.0, np.float32), "", "stop", 0, float(k % 2), k % 2 == 1)
        for k in range(4)
    ]
    return [Group("g0", "p0", "", ids.tolist(), "", samples=samples)]


def timed_step(trainer: Any, seed: int) -> float:
    started = time.perf_counter()
    trainer.train(groups(trainer.policy.module.config.vocab_size), seed)
    return time.perf_counter() - started


def write_once(trainer: Any, tag: str) -> dict[str, Any]:
    """A checkpoint waited for: total seconds (copy + write), the write's, bytes, MB/s."""
    started = time.perf_counter()
    (result,) = trainer.checkpoint(tag, {"step": 0}, wait=True)
    total = time.perf_counter() - started
    return {
        "seconds": total,
        "write_seconds": result.seconds,
        "copy_seconds": total - result.seconds,
        "bytes": result.nbytes,
        "mb_per_s": result.nbytes / result.seconds / 1e6,
    }


def beside_a_write(trainer: Any, steps: int) -> dict[str, Any]:
    """Step times with no write (before and after: the machine's load drifts), and
    while a background checkpoint is written."""
    timed_step(trainer, 0)  # warm-up (and Adam's state exists)
    alone = [timed_step(trainer, 1 + i) for i in range(steps)]
    started = time.perf_counter()
    trainer.checkpoint("step_bg", {"step": 0}, wait=False)
    copy_s = time.perf_counter() - started
    during: list[float] = []
    while trainer.writer.busy or not during:
        during.append(timed_step(trainer, 100 + len(during)))
    result = trainer.settle(wait=True)
    write_s = result.seconds if result is not None else float("nan")
    alone += [timed_step(trainer, 200 + i) for i in range(steps)]  # the load drifts
    return {
        "alone_seconds": alone,
        "during_write_seconds": during,
        "copy_seconds_on_the_training_thread": copy_s,
        "background_write_seconds": write_s,
        "ratio": statistics.median(alone) / statistics.median(during),
    }


def bench_model(root: Path, name: str, reps: int, steps: int) -> dict[str, Any]:
    model = model_dir(root, name)
    trainer = trainer_for(model, root / f"ck-{name}")
    params = sum(p.numel() for p in trainer.policy.module.parameters())
    timed_step(trainer, 0)  # Adam's state exists: the checkpoint holds it
    writes = [write_once(trainer, f"step{i}") for i in range(reps)]
    out: dict[str, Any] = {"parameters": params, "writes": writes}
    out["seconds_median"] = statistics.median(w["seconds"] for w in writes)
    out["mb_per_s_median"] = statistics.median(w["mb_per_s"] for w in writes)
    if steps:
        out["training_beside_a_write"] = beside_a_write(trainer, steps)
    return out


def main(argv: list[str] | None = None) -> int:
    """Both models' write times, the step-time ratio; 0 when every check is ok."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3, help="checkpoints written per model")
    parser.add_argument("--steps", type=int, default=3, help="steps timed with no write")
    args = parser.parse_args(argv if argv is not None else [])
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    load = os.getloadavg()
    setup = configure_process("learner", None)  # as `dapo learner` does
    with tempfile.TemporaryDirectory(dir=os.environ.get("DAPO_BENCH_DIR")) as tmp:
        tiny = bench_model(Path(tmp), "tiny", args.reps, 0)
        print(f"tiny: {tiny['seconds_median']:.2f}s", flush=True)
        half = bench_model(Path(tmp), "half-0.5b", max(1, args.reps - 1), args.steps)
        print(f"half-0.5b: {half['seconds_median']:.2f}s", flush=True)
    ratio = half["training_beside_a_write"]["ratio"]
    result = {
        "machine": machine(load),
        "process": setup,
        "engine": "deepspeed zero0 fp32 on CPU; files fsynced; temporary dir on the root disk",
        "tiny": tiny,
        "half_0_5b": half
        | {"shape": f"Qwen2.5-0.5B layers x{HALF_05B.num_hidden_layers}, vocab 4096"},
        "checks": [at_least("step_time_alone_vs_during_async_write", ratio, TARGET_STEP_RATIO)],
    }
    return write_result(RESULTS, result)


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
