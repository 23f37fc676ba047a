"""`dapo bench learner_memory`: the learner's peak memory at long lengths, in the process
users run.

Each row is a real `dapo learner` process training one long group; its peak RSS at 16k
tokens is checked against a bare `Trainer` process (≤ 1.2x), with the memory slope from
4k to 16k (≤ 0.10 fp32 logit rows per token) and the 4k step time against the
full-logits path (≤ 1.3x). Writes benchmarks/results/learner_memory.json. Model, rows
and method: benchmarks/README.md, "`learner_memory`".
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._results import check, result_path, write_result

ROOT = Path(__file__).resolve().parent.parent
RESULTS = result_path("learner_memory")
VOCAB, PROMPT, CHUNK, THREADS = 151_936, 256, 512, 2
TARGET_SLOPE, TARGET_TIME, TARGET_BARE = 0.10, 1.3, 1.2
ROW_TIMEOUT_S = 1800
ENGINES = {
    "fp32_zero0": {"learner.deepspeed.zero_stage": 0, "learner.dtype": "float32"},
    "bf16_zero2": {"learner.deepspeed.zero_stage": 2, "learner.dtype": "bfloat16"},
    "bf16_zero3": {"learner.deepspeed.zero_stage": 3, "learner.dtype": "bfloat16"},
}


def build_model(out: Path) -> dict[str, int]:
    """A random Qwen2 with the Qwen2.5 vocabulary and a small body, plus a tokenizer."""
    from benchmarks._models import BENCH_SHAPE, random_qwen2
    from learner.init_model import init_model

    init_model(out, preset="tiny", seed=0)  # its tokenizer; the model is replaced below
    model = random_qwen2(VOCAB, BENCH_SHAPE, seed=0)
    model.save_pretrained(out)
    total = sum(p.numel() for p in model.parameters())
    return {"parameters": total, "embedding_parameters": VOCAB * BENCH_SHAPE.hidden_size}


def make_group(tokens: int, name: str) -> Any:
    """One prompt, two responses: `tokens` - 256 tokens (correct) and 1 token (wrong)."""
    from services.common.types import Group, Sample

    rng = random.Random(tokens)
    prompt = [rng.randrange(1, VOCAB) for _ in range(PROMPT)]
    long = [rng.randrange(1, VOCAB) for _ in range(tokens - PROMPT)]
    samples = [
        Sample(long, [-2.0] * len(long), "", "stop", 0, 1.0, True),
        Sample(long[:1], [-2.0], "", "stop", 0, -1.0, False),
    ]
    return Group(name, "p", "", prompt, "", samples=samples)


def overrides(model_dir: Path, row: dict[str, Any], run: str) -> list[str]:
    """The row's settings over `--preset tiny`, as `--set` pairs."""
    sets = {
        "shared.run_name": run,
        "shared.model_path": str(model_dir),
        "shared.model_init": "null",
        "shared.max_prompt_length": PROMPT,
        "shared.max_response_length": row["tokens"],
        "shared.train_batch_groups": 1,
        "shared.max_staleness": 100,
        "shared.torch_threads": THREADS,
        "learner.engine": "deepspeed",
        "learner.optimizer.lr": 1e-6,
        "learner.batching.mini_batch_responses": 2,
        "learner.batching.micro_batch_tokens": row["tokens"] + PROMPT,
        "learner.batching.logprob_chunk_tokens": row["chunk"],
        "learner.batching.gradient_checkpointing": str(row["checkpointing"]).lower(),
        "learner.total_steps": 2,
        "learner.linger_s": 3600,
        **ENGINES[row["engine"]],
    }
    return [arg for k, v in sets.items() for arg in ("--set", f"{k}={v}")]


def status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def reset_peak(pid: int) -> None:
    """Restart the process's VmHWM from its current RSS (Linux >= 4.0)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def launched_row(model_dir: Path, row: dict[str, Any], log: Path) -> dict[str, Any]:
    """The row in a real `dapo learner` process, as `dapo up` starts it."""
    from services.common.adapters import encode_group
    from services.common.keys import RunKeys
    from services.common.redis_server import connect, start_redis
    from services.tools.launcher import child_env

    server = start_redis()
    client, keys = connect(server.url), RunKeys("bench")
    cmd = [
        sys.executable,
        "-m",
        "services.tools.cli",
        "learner",
        "--preset",
        "tiny",
        "--redis-url",
        server.url,
        "--grpc-port",
        "0",
        "--http-port",
        "0",
        *overrides(model_dir, row, "bench"),
    ]
    env = child_env() | {"PYTHONPATH": f"{ROOT}:{ROOT / 'proto'}"}
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        client.xadd(keys.train, {"group": encode_group(make_group(PROMPT + 256, "warm"))})
        wait_version(client, keys, proc, 1)
        reset_peak(proc.pid)
        client.xadd(keys.train, {"group": encode_group(make_group(row["tokens"], "long"))})
        wait_version(client, keys, proc, 2)
        peak = status_kib(proc.pid, "VmHWM") * 1024
        (entry,) = client.xrevrange(keys.metrics, count=1)
        seconds = json.loads(entry[1][b"json"])["seconds"]
        return {"ok": True, "peak_rss_bytes": peak, "step_s": seconds}
    except RuntimeError as exc:
        return {"ok": False, "error": str(exc), "log_tail": log.read_text()[-2000:]}
    finally:
        proc.kill()
        proc.wait()
        server.stop()


def wait_version(client: Any, keys: Any, proc: subprocess.Popen, version: int) -> None:
    deadline = time.monotonic() + ROW_TIMEOUT_S
    while int(client.get(keys.version) or 0) < version:
        if proc.poll() is not None:
            raise RuntimeError(f"the learner exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no version {version} after {ROW_TIMEOUT_S} s")
        time.sleep(0.2)


def bare_step(model_dir: str, row: dict[str, Any]) -> dict[str, Any]:
    """In this process (glibc defaults): `Trainer` alone, warm-up, reset, measured step."""
    import torch

    from learner.config import LearnerSettings
    from learner.dist import Single
    from learner.trainer import Trainer
    from services.common.adapters import decode_group, encode_group
    from services.common.config_loader import load_settings

    torch.set_num_threads(THREADS)
    settings = load_settings(
        LearnerSettings,
        None,
        preset="tiny",
        overrides=overrides(Path(model_dir), row, "bare")[1::2],
    )
    trainer = Trainer(settings, Single())
    for name, tokens in (("warm", PROMPT + 256), ("long", row["tokens"])):
        if name == "long":
            reset_peak(os.getpid())
        group = decode_group(encode_group(make_group(tokens, name)))
        metrics = trainer.train([group], seed=0, version=0)
    return {
        "ok": True,
        "peak_rss_bytes": status_kib(os.getpid(), "VmHWM") * 1024,
        "step_s": metrics.seconds,
    }


def bare_row(model_dir: Path, row: dict[str, Any]) -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.learner_memory",
        "--bare",
        str(model_dir),
        json.dumps(row),
    ]
    env = dict(os.environ, PYTHONPATH=f"{ROOT}:{ROOT / 'proto'}", DS_ACCELERATOR="cpu")
    proc = subprocess.run(
        cmd, env=env, capture_output=True, text=True, cwd=ROOT, timeout=ROW_TIMEOUT_S
    )
    if proc.returncode != 0:
        return {"ok": False, "returncode": proc.returncode, "error": proc.stderr[-2000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def plan_rows() -> list[dict[str, Any]]:
    """The 16k pairs first (the checks that matter most), then the 4k rows."""

    def row(engine: str, tokens: int, process: str = "launched", chunk: int = CHUNK) -> dict:
        return {
            "engine": engine,
            "tokens": tokens,
            "process": process,
            "chunk": chunk,
            "checkpointing": chunk > 0,
        }

    rows = [row(e, 16384, p) for e in ENGINES for p in ("launched", "bare")]
    rows.append(row("fp32_zero0", 4096))
    rows.append(row("fp32_zero0", 4096, chunk=0))  # full logits: the time check's baseline
    return rows


def run_row(tmp: Path, index: int, row: dict[str, Any]) -> dict[str, Any]:
    started = time.monotonic()
    if row["process"] == "bare":
        result = bare_row(tmp / "model", row)
    else:
        result = launched_row(tmp / "model", row, tmp / f"learner-{index}.log")
    done = row | result | {"wall_s": round(time.monotonic() - started, 1)}
    print(summary(done), flush=True)
    return done


def run_rows(tmp: Path, rows: list[dict[str, Any]], parallel: int) -> list[dict[str, Any]]:
    """The 16k rows `parallel` at a time (peaks are per process), then the rest alone."""
    from concurrent.futures import ThreadPoolExecutor

    long = [(i, r) for i, r in enumerate(rows) if r["tokens"] == 16384]
    with ThreadPoolExecutor(max(1, parallel)) as pool:
        done = list(pool.map(lambda ir: run_row(tmp, *ir), long))
    rest = [run_row(tmp, i, r) for i, r in enumerate(rows) if r["tokens"] != 16384]
    return done + rest


def find(
    rows: list[dict], engine: str, tokens: int, process: str = "launched", chunk: int = CHUNK
) -> dict:
    for r in rows:
        if (r["engine"], r["tokens"], r["process"], r["chunk"]) == (engine, tokens, process, chunk):
            return r
    return {"ok": False}


def checks(rows: list[dict]) -> list[dict[str, Any]]:
    out = []
    for engine in ENGINES:
        launched, bare = find(rows, engine, 16384), find(rows, engine, 16384, "bare")
        ratio = (
            launched["peak_rss_bytes"] / bare["peak_rss_bytes"]
            if launched["ok"] and bare["ok"]
            else None
        )
        out.append(
            check(
                f"{engine}_16k_launched_peak_vs_bare",
                ratio,
                f"<= {TARGET_BARE}",
                ratio is not None and ratio <= TARGET_BARE,
                digits=4,
            )
        )
    a, b = find(rows, "fp32_zero0", 4096), find(rows, "fp32_zero0", 16384)
    slope = (
        (b["peak_rss_bytes"] - a["peak_rss_bytes"]) / (12288 * VOCAB * 4)
        if a["ok"] and b["ok"]
        else None
    )
    out.append(
        check(
            "fp32_zero0_memory_slope_4k_to_16k_in_logit_rows",
            slope,
            f"<= {TARGET_SLOPE}",
            slope is not None and slope <= TARGET_SLOPE,
            digits=4,
        )
    )
    new, old = find(rows, "fp32_zero0", 4096), find(rows, "fp32_zero0", 4096, chunk=0)
    ratio = new["step_s"] / old["step_s"] if new["ok"] and old["ok"] else None
    out.append(
        check(
            "step_time_4k_vs_full_logits",
            ratio,
            f"<= {TARGET_TIME}",
            ratio is not None and ratio <= TARGET_TIME,
            digits=4,
        )
    )
    return out


def summary(row: dict) -> str:
    head = f"{row['engine']:<10} {row['process']:<8} {row['tokens']:>6} chunk={row['chunk']:<4}"
    if not row["ok"]:
        return f"{head} FAILED: {row.get('error', '')[-300:]}"
    return f"{head} peak {row['peak_rss_bytes'] / 2**30:6.2f} GiB  step {row['step_s']:7.1f} s"


def main(argv: list[str] | None = None) -> int:
    """Run every row, write the JSON; 0 when every check is ok."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bare", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument(
        "--parallel",
        type=int,
        default=1,
        help="run this many 16k rows at once (each in its own process, its own peak); "
        "the 4k rows, whose times are compared, always run alone",
    )
    args = parser.parse_args(argv if argv is not None else [])
    if args.bare:
        print(json.dumps(bare_step(args.bare[0], json.loads(args.bare[1]))))
        return 0
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    with tempfile.TemporaryDirectory(prefix="dapo-bench-memory-") as tmp:
        model = build_model(Path(tmp) / "model")
        rows = run_rows(Path(tmp), plan_rows(), args.parallel)
    result = {
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "load_avg_1m": os.getloadavg()[0],
        },
        "process": "launched rows: `python -m services.tools.cli learner --preset tiny` with "
        "the launcher's child environment, configured by configure_process('learner')",
        "model": model | {"vocab": VOCAB},
        "prompt_tokens": PROMPT,
        "torch_threads": THREADS,
        "logprob_chunk_tokens": CHUNK,
        "parallel_16k_rows": args.parallel,
        "rows": rows,
        "checks": checks(rows),
    }
    return write_result(RESULTS, result)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
