"""The GPU check (scripts/gpu_check.sh runs it): the torch engine generating on the GPU,
one learner step at 4k / 16k / 32k tokens on a Qwen2.5-1.5B-shaped random model in bf16
(peak allocated memory, tokens/s), and a weight publication to a rollout server whose
engine is on the GPU. Writes its figures as JSON (for docs/gpu.md) to the path given.

Every part runs in this order and each is recorded as it finishes, so a failure late on
keeps the figures before it. Without CUDA it stops before the first part and says so.
"""

from __future__ import annotations

import json
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
STEP_TOKENS = (4096, 16384, 32768)
PROMPT = 256


def device_facts() -> dict[str, Any]:
    import torch

    props = torch.cuda.get_device_properties(0)
    return {
        "device": props.name,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "platform": platform.platform(),
    }


def save_model(out: Path) -> int:
    """A random Qwen2.5-1.5B-shaped model in bf16 (the tiny preset's tokenizer is not
    needed: steps and generation take token ids)."""
    import torch

    from benchmarks._models import random_qwen2
    from learner.init_model import PRESETS, ModelShape

    with torch.device("cuda"):  # Qwen2.5-1.5B: vocabulary 151,936, 28 layers, hidden 1536
        shape = ModelShape(1536, 8960, 28, 12, 2, 32768, True)
        model = random_qwen2(151936, shape, seed=0).to(torch.bfloat16)
    model.save_pretrained(out)
    PRESETS["small"].build_tokenizer().save_pretrained(out)  # any tokenizer: ids only
    return sum(p.numel() for p in model.parameters())


def generation(model_dir: Path) -> dict[str, Any]:
    """The torch engine on the GPU: 8 prompts x 8 samples x 256 tokens, bf16."""
    import torch

    from rollout.engine import SamplingParams
    from rollout.torch_engine import TorchEngine

    engine = TorchEngine(model_dir, device="cuda", dtype="bfloat16", max_batch_size=64)
    prompts = [[10 + i, 20 + i, 30 + i, 40 + i] for i in range(8)]
    params = SamplingParams(n=8, max_tokens=256, ignore_eos=True, seed=1)
    engine.generate(prompts[:1], SamplingParams(n=1, max_tokens=8, seed=0))  # warm-up
    torch.cuda.synchronize()
    started = time.perf_counter()
    out = engine.generate(prompts, params)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    tokens = sum(len(s.token_ids) for row in out for s in row)
    finite = all(bool((s.logprobs <= 0).all()) for row in out for s in row)
    del engine
    torch.cuda.empty_cache()
    return {
        "samples": 64,
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 1),
        "logprobs_ok": finite,
    }


def make_group(tokens: int) -> Any:
    """One prompt of 256 tokens, a response filling `tokens` in all (correct) and a
    one-token one (wrong), as benchmarks/learner_memory.py."""
    import random

    from services.common.types import Group, Sample

    rng = random.Random(tokens)
    prompt = [rng.randrange(1, 151936) for _ in range(PROMPT)]
    long = [rng.randrange(1, 151936) for _ in range(tokens - PROMPT)]
    samples = [
        Sample(long, [-2.0] * len(long), "", "stop", 0, 1.0, True),
        Sample(long[:1], [-2.0], "", "stop", 0, -1.0, False),
    ]
    return Group("g", "p", "", prompt, "", samples=samples)


def learner_steps(model_dir: Path) -> list[dict[str, Any]]:
    """One DAPO step per length on the GPU (torch policy, bf16, chunked log-probs,
    activation checkpointing), after a short warm-up step that allocates the optimizer."""
    import torch

    from learner.config import BatchingConfig, LearnerConfig, OptimizerConfig
    from learner.model_io import load_model
    from learner.step import train_step
    from learner.torch_policy import TorchPolicy

    rows = []
    cfg = LearnerConfig(
        engine="torch",
        dtype="bfloat16",
        optimizer=OptimizerConfig(lr=1e-6, warmup_steps=0),
        batching=BatchingConfig(
            mini_batch_responses=2,
            micro_batch_tokens=max(STEP_TOKENS),
            gradient_checkpointing=True,
        ),
    )
    policy = TorchPolicy(load_model(model_dir, "bfloat16"), cfg, device="cuda")
    train_step(policy, [make_group(PROMPT + 256)], cfg, 0, 1.0, max(STEP_TOKENS))
    for tokens in STEP_TOKENS:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        try:
            metrics = train_step(policy, [make_group(tokens)], cfg, 0, 1.0, tokens, seed=tokens)
            torch.cuda.synchronize()
        except torch.OutOfMemoryError as exc:
            rows.append({"tokens": tokens, "error": f"out of memory: {exc}"[:300]})
            torch.cuda.empty_cache()
            continue
        seconds = time.perf_counter() - started
        rows.append(
            {
                "tokens": tokens,
                "seconds": round(seconds, 3),
                "tokens_per_s": round(tokens / seconds, 1),
                "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
                "grad_norm": float(metrics.grad_norm),
            }
        )
        print(f"learner step {tokens} tokens: {rows[-1]}", flush=True)
    del policy
    torch.cuda.empty_cache()
    return rows


def publication(model_dir: Path) -> dict[str, Any]:
    """benchmarks/weights.py's learner stand-in publishing to one rollout server whose
    torch engine is on the GPU: seconds from publish to served, per version."""
    from benchmarks import weights

    result = weights.run(model_dir, [1], versions=4, sync=False, device="cuda")
    return {"model_bytes": result["model_bytes"], "one_server": result["servers_1"]}


def import_parts() -> None:
    """Everything the parts import, before any needs CUDA: a missing wheel shows here."""
    import benchmarks._models  # noqa: F401
    import benchmarks.weights  # noqa: F401
    import learner.step  # noqa: F401
    import learner.torch_policy  # noqa: F401
    import rollout.server  # noqa: F401
    import rollout.torch_engine  # noqa: F401
    from learner.init_model import PRESETS

    PRESETS["small"].build_tokenizer()


def main(out: str) -> int:
    import torch

    path = Path(out)
    import_parts()
    print("gpu_check: the engine, learner and weight transport import", flush=True)
    if not torch.cuda.is_available():
        print(
            "gpu_check: CUDA is not available here; stopping before the GPU parts "
            "(everything up to this point ran)",
            flush=True,
        )
        path.write_text(json.dumps({"status": "no CUDA", "torch": torch.__version__}) + "\n")
        return 3
    figures: dict[str, Any] = {"status": "running", **device_facts()}
    parts = (
        ("generation", generation),
        ("learner_steps", learner_steps),
        ("publication", publication),
    )
    with tempfile.TemporaryDirectory(prefix="dapo-gpu-check-") as tmp:
        model_dir = Path(tmp) / "qwen2.5-1.5b-shaped"
        figures["parameters"] = save_model(model_dir)
        for name, part in parts:
            started = time.perf_counter()
            try:
                figures[name] = part(model_dir)
            except Exception:
                figures[name] = {"error": traceback.format_exc()[-2000:]}
            figures[f"{name}_wall_s"] = round(time.perf_counter() - started, 1)
            path.write_text(json.dumps(figures, indent=2) + "\n")
            print(f"{name}: {json.dumps(figures[name])[:400]}", flush=True)
    figures["status"] = "done"
    path.write_text(json.dumps(figures, indent=2) + "\n")
    return 0 if not any("error" in str(figures[n])[:20] for n, _ in parts) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
