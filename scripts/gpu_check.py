"""The GPU check (scripts/gpu_check.sh runs it), in this order, each part recorded as it
finishes (a late failure keeps the figures before it):
  a. `dapo up --preset tiny`: torch rollout engine and DeepSpeed learner (ZeRO-2, bf16)
     on the device, to the end; the ledger checked, held-out accuracy before and after;
  b. the same with `--rollouts 2` sharing the device (skipped, with the reason, when the
     GPU has too little free memory);
  c. the torch engine generating, then DeepSpeed learner steps at 4k/16k/32k tokens as
     `dapo learner` builds the policy, on a Qwen2.5-1.5B-shaped random model;
  d. the weight path into a rollout server whose engine is on the device, timed against a
     raw host-to-device copy of the same bytes.
`--device cpu` runs every part small (the tiny model, a few steps): tests/test_gpu_check.py.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
STEP_TOKENS = {"cuda": (4096, 16384, 32768), "cpu": (64, 128)}
PROMPT = 256
FREE_GIB_FOR_TWO = 8.0  # part b: free GPU memory two tiny runs' processes need, with room


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def device_facts(device: str) -> dict[str, Any]:
    import torch

    facts = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "platform": platform.platform(),
    }
    if device != "cuda":
        return {"device": "cpu", "cores": len(os.sched_getaffinity(0)), **facts}
    props = torch.cuda.get_device_properties(0)
    free, _ = torch.cuda.mem_get_info()
    return {
        "device": props.name,
        "gpus": torch.cuda.device_count(),
        "memory_gib": round(props.total_memory / 2**30, 1),
        "free_gib": round(free / 2**30, 1),
        **facts,
    }


# ------------------------------------------------------------------ a, b: dapo up
def up_overrides(device: str, run_name: str, model: Path) -> list[str]:
    """The tiny preset with the torch engine and the DeepSpeed learner on `device`."""
    dtype = "bfloat16" if device == "cuda" else "float32"
    sets = {
        "shared.run_name": run_name,
        "shared.model_path": str(model),
        "rollout.engine.device": device,
        "rollout.engine.dtype": dtype,
        "learner.engine": "deepspeed",
        "learner.deepspeed.zero_stage": 2,
        "learner.dtype": dtype,
        "learner.device": "auto",
    }
    if device != "cuda":  # the CPU mode keeps its held-out evaluations short
        sets["controller.eval.limit"] = 32
    return [arg for k, v in sets.items() for arg in ("--set", f"{k}={v}")]


def dapo_up(out: Path, device: str, steps: int, rollouts: int, timeout_s: float) -> dict:
    """`dapo up` as a user runs it; its report's ledger, steps and evaluations checked."""
    run_dir = out / f"up-rollouts-{rollouts}"
    cmd = [
        sys.executable, "-m", "services.tools.cli", "up", "--preset", "tiny",
        "--run-dir", str(run_dir), "--steps", str(steps), "--rollouts", str(rollouts),
        *up_overrides(device, f"gpu-check-{rollouts}", out / "models" / "tiny"),
    ]  # fmt: skip
    started, seen = time.perf_counter(), {}
    with (out / f"up-rollouts-{rollouts}.log").open("w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        while proc.poll() is None:  # each GPU role's CUDA_VISIBLE_DEVICES, while it runs
            seen.update(role_gpus(proc.pid))
            if time.perf_counter() - started > timeout_s:
                proc.kill()
                raise TimeoutError(f"dapo up still running after {timeout_s:.0f} s")
            time.sleep(0.5)
    report = json.loads((run_dir / "report.json").read_text())
    ledger = report["ledger"]
    result = {
        "exit_code": proc.returncode,
        "visible_gpus": {
            role: sorted(gpus for r, gpus in seen.values() if r == role)
            for role in ("learner", "rollout")
        },
        "wall_s": round(time.perf_counter() - started, 1),
        "steps": len(report["steps"]),
        "ledger_ok": ledger["ok"],
        "ledger_problems": ledger["problems"],
        "eval_before": report.get("eval_before"),
        "eval_after": report.get("eval_after"),
    }
    if proc.returncode != 0 or not ledger["ok"] or result["steps"] != steps:
        raise RuntimeError(f"dapo up did not train as it should: {json.dumps(result)[:600]}")
    return result


def role_gpus(pid: int) -> dict[int, tuple[str, str]]:
    """pid → (role, CUDA_VISIBLE_DEVICES) of the learner and rollout servers `dapo up`
    (process `pid`) started: what the launcher assigned them (services/tools/gpus.py)."""
    import psutil

    found = {}
    for child in psutil.Process(pid).children():
        try:
            cmd, env = child.cmdline(), child.environ()
        except psutil.Error:  # gone, or not started yet
            continue
        role = cmd[3] if cmd[1:3] == ["-m", "services.tools.cli"] and len(cmd) > 3 else ""
        if role in ("learner", "rollout"):
            found[child.pid] = (role, env.get("CUDA_VISIBLE_DEVICES", "unset"))
    return found


def two_rollouts_fit(device: str) -> str | None:
    """Why part b is skipped (None: run it)."""
    if device != "cuda":
        return None
    import torch

    free = torch.cuda.mem_get_info()[0] / 2**30
    if free < FREE_GIB_FOR_TWO:
        return f"{free:.1f} GiB free on the GPU, under the {FREE_GIB_FOR_TWO} GiB two runs need"
    return None


# ------------------------------------------------------------------ c: engine, learner
def save_model(out: Path, device: str) -> int:
    """On the GPU a random Qwen2.5-1.5B-shaped model in bf16 (the small preset's tokenizer:
    steps and generation take token ids); on the CPU the tiny preset's model."""
    import torch

    from benchmarks._models import random_qwen2
    from learner.init_model import PRESETS, ModelShape, init_model

    if device != "cuda":
        init_model(out, preset="tiny", seed=0)
        return sum(p.numel() for p in load(out, "float32").parameters())
    with torch.device("cuda"):  # Qwen2.5-1.5B: vocabulary 151,936, 28 layers, hidden 1536
        shape = ModelShape(1536, 8960, 28, 12, 2, 32768, True)
        model = random_qwen2(151936, shape, seed=0).to(torch.bfloat16)
    model.save_pretrained(out)
    PRESETS["small"].build_tokenizer().save_pretrained(out)  # any tokenizer: ids only
    return sum(p.numel() for p in model.parameters())


def load(model_dir: Path, dtype: str) -> Any:
    from learner.model_io import load_model

    return load_model(model_dir, dtype)


def vocabulary(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


def generation(model_dir: Path, device: str) -> dict[str, Any]:
    """The torch engine on the device: 8 prompts x 8 samples x 256 tokens (bf16 on the
    GPU; 2 x 4 x 16 in float32 on the CPU)."""
    from rollout.engine import SamplingParams
    from rollout.torch_engine import TorchEngine

    small = device != "cuda"
    prompts_n, n, tokens = (2, 4, 16) if small else (8, 8, 256)
    dtype = "float32" if small else "bfloat16"
    engine = TorchEngine(model_dir, device=device, dtype=dtype, max_batch_size=64)
    vocab = vocabulary(model_dir)
    prompts = [[(10 * k + i) % vocab for k in range(1, 5)] for i in range(prompts_n)]
    params = SamplingParams(n=n, max_tokens=tokens, ignore_eos=True, seed=1)
    engine.generate(prompts[:1], SamplingParams(n=1, max_tokens=8, seed=0))  # warm-up
    sync(device)
    started = time.perf_counter()
    out = engine.generate(prompts, params)
    sync(device)
    seconds = time.perf_counter() - started
    made = sum(len(s.token_ids) for row in out for s in row)
    finite = all(bool((s.logprobs <= 0).all()) for row in out for s in row)
    engine.close()
    return {
        "samples": prompts_n * n,
        "tokens": made,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(made / seconds, 1),
        "logprobs_ok": finite,
    }


def make_group(tokens: int, prompt: int = PROMPT, vocab: int = 151936) -> Any:
    """One prompt of `prompt` tokens, a response filling `tokens` in all (correct) and a
    one-token one (wrong), as benchmarks/learner_memory.py."""
    import random

    from services.common.types import Group, Sample

    rng = random.Random(tokens)
    ids = [rng.randrange(1, vocab) for _ in range(prompt)]
    long = [rng.randrange(1, vocab) for _ in range(tokens - prompt)]
    samples = [
        Sample(long, [-2.0] * len(long), "", "stop", 0, 1.0, True),
        Sample(long[:1], [-2.0], "", "stop", 0, -1.0, False),
    ]
    return Group("g", "p", "", ids, "", samples=samples)


def learner_steps(model_dir: Path, device: str, step_tokens: tuple[int, ...]) -> list[dict]:
    """One DAPO step per length with the DeepSpeed policy as `dapo learner` builds it
    (ZeRO-2, bf16 on the GPU, chunked log-probs, activation checkpointing), after a short
    warm-up step that allocates the optimizer."""
    import torch

    from learner.backends import build_policy
    from learner.step import train_step
    from services.tools.config import load_config

    rows = []
    cfg = load_config(
        overrides=[
            "learner.engine=deepspeed",
            "learner.deepspeed.zero_stage=2",
            f"learner.dtype={'bfloat16' if device == 'cuda' else 'float32'}",
            "learner.device=auto",
            "learner.optimizer.warmup_steps=0",
            "learner.batching.mini_batch_responses=2",
            f"learner.batching.micro_batch_tokens={max(step_tokens)}",
            "learner.batching.gradient_checkpointing=true",
        ]
    ).learner
    policy = build_policy(model_dir, cfg)  # what learner.trainer.Trainer builds
    prompt = min(PROMPT, min(step_tokens) // 2)
    vocab = vocabulary(model_dir)
    train_step(policy, [make_group(prompt + 8, prompt, vocab)], cfg, 0, 1.0, max(step_tokens))
    for tokens in step_tokens:
        sync(device)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        try:
            group = make_group(tokens, prompt, vocab)
            metrics = train_step(policy, [group], cfg, 0, 1.0, tokens, seed=tokens)
            sync(device)
        except torch.OutOfMemoryError as exc:
            rows.append({"tokens": tokens, "error": f"out of memory: {exc}"[:300]})
            torch.cuda.empty_cache()
            continue
        seconds = time.perf_counter() - started
        peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
        rows.append(
            {
                "tokens": tokens,
                "seconds": round(seconds, 3),
                "tokens_per_s": round(tokens / seconds, 1),
                "peak_allocated_gib": None if peak is None else round(peak, 2),
                "grad_norm": float(metrics.grad_norm),
                "engine": type(policy).__name__,
                "policy_device": str(policy.device),
            }
        )
        print(f"learner step {tokens} tokens: {rows[-1]}", flush=True)
    del policy
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------ d: the weight path
def raw_copy(nbytes: int, device: str) -> dict[str, Any]:
    """A host-to-device copy of `nbytes` from pinned memory (on the CPU: a host memcpy),
    median of 5: the floor the weight path is held against."""
    import statistics

    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device == "cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(5):
        sync(device)
        started = time.perf_counter()
        dst.copy_(src, non_blocking=False)
        sync(device)
        times.append(time.perf_counter() - started)
    seconds = statistics.median(times)
    return {"seconds": round(seconds, 7), "bytes_per_s": round(nbytes / seconds)}


def weight_path(model_dir: Path, device: str) -> dict[str, Any]:
    """benchmarks/weights.py's learner stand-in publishing to one rollout server whose
    torch engine is on `device`: seconds from publish to served per version, against a
    raw host-to-device copy of the same bytes."""
    from benchmarks import weights

    versions = 4 if device == "cuda" else 3  # the first two are cold (weights.summary)
    result = weights.run(model_dir, [1], versions=versions, sync=False, device=device)
    one, nbytes = result["servers_1"], result["model_bytes"]
    raw = raw_copy(nbytes, device)
    return {
        "model_bytes": nbytes,
        "seconds_per_version": one["seconds"],
        "raw_h2d": raw,
        "raw_over_path": round(raw["seconds"] / one["seconds"], 5),
        "one_server": {k: v for k, v in one.items() if k not in ("runs", "cold")},
    }


# ------------------------------------------------------------------ the parts, in order
def import_parts() -> None:
    """Everything the parts import, before any needs CUDA: a missing wheel shows here."""
    import deepspeed  # noqa: F401

    import benchmarks._models  # noqa: F401
    import benchmarks.weights  # noqa: F401
    import learner.backends  # noqa: F401
    import learner.step  # noqa: F401
    import rollout.server  # noqa: F401
    import rollout.torch_engine  # noqa: F401
    import services.tools.launcher  # noqa: F401
    from learner.init_model import PRESETS

    PRESETS["small"].build_tokenizer()


def parts(args: argparse.Namespace, out: Path, model_dir: Path) -> list[tuple[str, Callable]]:
    device, steps, limit = args.device, args.steps, args.up_timeout_s

    def two() -> dict:
        why = two_rollouts_fit(device)
        return {"skipped": why} if why else dapo_up(out, device, steps, 2, limit)

    def engine_and_learner() -> dict:
        return {
            "parameters": save_model(model_dir, device),
            "generation": generation(model_dir, device),
            "learner_steps": learner_steps(model_dir, device, STEP_TOKENS[device]),
        }

    return [
        ("a_up", lambda: dapo_up(out, device, steps, 1, limit)),
        ("b_up_two_rollouts", two),
        ("c_engine_learner", engine_and_learner),
        ("d_weight_path", lambda: weight_path(model_dir, device)),
    ]


def failed(value: Any) -> bool:
    rows = value if isinstance(value, list) else [value]
    return any(isinstance(r, dict) and "error" in r for r in rows) or (
        isinstance(value, dict) and any(failed(v) for v in value.values() if isinstance(v, list))
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", help="the figures' JSON file")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--steps", type=int, default=10, help="dapo up's steps (a, b)")
    parser.add_argument("--up-timeout-s", type=float, default=420.0)
    parser.add_argument("--parts", default="abcd", help="which parts run (letters, in order)")
    args = parser.parse_args(argv)
    import torch

    path = Path(args.out)
    import_parts()
    print("gpu_check: the engine, learner, launcher and weight transport import", flush=True)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "gpu_check: CUDA is not available here; stopping before the GPU parts "
            "(everything up to this point ran; --device cpu runs them on the CPU)",
            flush=True,
        )
        path.write_text(json.dumps({"status": "no CUDA", "torch": torch.__version__}) + "\n")
        return 3
    figures: dict[str, Any] = {
        "status": "running",
        "steps": args.steps,
        **device_facts(args.device),
    }
    names = []
    with tempfile.TemporaryDirectory(prefix="dapo-gpu-check-") as tmp:
        out, model_dir = Path(tmp), Path(tmp) / "model"
        for name, part in parts(args, out, model_dir):
            if name[0] not in args.parts:
                continue
            names.append(name)
            started = time.perf_counter()
            try:
                figures[name] = part()
            except Exception:
                figures[name] = {"error": traceback.format_exc()[-2000:]}
                for log in sorted(out.glob("*.log")):  # the dapo up output, for the record
                    print(f"--- {log.name}\n{log.read_text()[-3000:]}", flush=True)
            figures[f"{name}_wall_s"] = round(time.perf_counter() - started, 1)
            path.write_text(json.dumps(figures, indent=2) + "\n")
            print(f"gpu_check: {name}: {json.dumps(figures[name])[:600]}", flush=True)
    figures["status"] = "done"
    path.write_text(json.dumps(figures, indent=2) + "\n")
    return 1 if any(failed(figures[n]) for n in names) else 0


if __name__ == "__main__":
    sys.exit(main())
