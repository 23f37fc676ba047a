"""Rollout throughput and weight-update time.

1. The torch engine's batched sampling on the tiny model against one-at-a-time
   `model.generate` on the same model and prompts (≥ 10x), and the same batch through
   the gRPC service; 2. a ≥ 100 MB weight update pulled from a real learner
   WeightService until served (≤ 5 s). Writes benchmarks/results/rollout_engine.json.
   Method, and why one torch thread: benchmarks/README.md, "`rollout_engine`".
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks._results import at_least, at_most, result_path, write_result

RESULTS = result_path("rollout_engine")
TARGET_SPEEDUP = 10.0
TARGET_UPDATE_S = 5.0
MIN_MODEL_MB = 100.0
BIG_MODEL = {  # ~35 M parameters, ~141 MB in fp32
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "vocab_size": 32000,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
}


# -- sampling --------------------------------------------------------------------------


def make_prompts(tokenizer: Any, count: int, seed: int = 0) -> list[list[int]]:
    """Synthetic `a,b,c=` prompts of a few digits, as the tiny preset trains on."""
    rng = random.Random(seed)
    texts = [
        ",".join(str(rng.randrange(10)) for _ in range(rng.randint(3, 6))) + "="
        for _ in range(count)
    ]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def time_engine(
    engine: Any, prompts: list[list[int]], group: int, tokens: int, ignore_eos: bool = True
) -> tuple[float, int]:
    """One batched engine call: (seconds, tokens generated)."""
    from rollout.engine import SamplingParams

    params = SamplingParams(n=group, temperature=1.0, max_tokens=tokens, ignore_eos=ignore_eos)
    start = time.perf_counter()
    out = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    lengths = [len(s.token_ids) for samples in out for s in samples]
    assert not ignore_eos or set(lengths) == {tokens}
    return seconds, sum(lengths)


def time_hf_loop(model: Any, prompts: list[list[int]], tokens: int, pad_id: int) -> float:
    """One `model.generate` per sample, with the log-probs of the sampled tokens."""
    import torch

    start = time.perf_counter()
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            pad_token_id=pad_id,
            output_scores=True,
            return_dict_in_generate=True,
        )
        model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
        assert out.sequences.shape[1] == len(prompt) + tokens
    return time.perf_counter() - start


def time_service(
    engine: Any, prompts: list[list[int]], group: int, tokens: int
) -> tuple[float, int]:
    """All prompts as concurrent GenerateGroup calls through a real gRPC server: (s, tokens)."""
    from dapo.v1 import rollout_pb2, rollout_pb2_grpc
    from rollout.server import RolloutServer
    from services.common.adapters import sample_from_completion
    from services.common.grpc_server import insecure_channel
    from services.tools.config import DapoConfig

    config = DapoConfig.model_validate(
        {"rollout": {"server": {"grpc_port": 0, "http_port": 0}, "max_n": group}}
    )
    server = RolloutServer(config, None, engine).start()
    counts: list[int] = []
    try:
        with insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
            stub = rollout_pb2_grpc.RolloutServiceStub(channel)

            def call(prompt: list[int]) -> None:
                sampling = rollout_pb2.SamplingParams(temperature=1.0, max_tokens=tokens)
                request = rollout_pb2.GenerateRequest(
                    prompt_token_ids=prompt, n=group, sampling=sampling
                )
                reply = stub.GenerateGroup(request)
                counts.append(
                    sum(len(sample_from_completion(c).token_ids) for c in reply.completions)
                )

            threads = [threading.Thread(target=call, args=(p,)) for p in prompts]
            start = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            seconds = time.perf_counter() - start
    finally:
        server.stop()
    if len(counts) != len(prompts):
        raise RuntimeError(f"{len(prompts) - len(counts)} GenerateGroup calls failed")
    return seconds, sum(counts)


def measure_sampling(model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Engine, service and HF loop on the same prompts; reps interleaved against noise."""
    from rollout.torch_engine import TorchEngine

    engine = TorchEngine(model_dir, device="cpu", max_batch_size=args.prompts * args.group)
    prompts = make_prompts(engine.tokenizer, args.prompts)
    subset = [p for p in prompts for _ in range(args.group)][: args.loop_samples]
    time_engine(engine, prompts[:2], 2, 4)  # warm both paths
    time_hf_loop(engine.model, subset[:1], 4, engine.pad_token_id)
    sides: dict[str, list[float]] = {"engine": [], "loop": []}
    for _ in range(args.reps):
        sides["engine"].append(time_engine(engine, prompts, args.group, args.tokens)[0])
        sides["loop"].append(time_hf_loop(engine.model, subset, args.tokens, engine.pad_token_id))
    eos_s, eos_tokens = time_engine(engine, prompts, args.group, args.tokens, ignore_eos=False)
    service_s, service_tokens = time_service(engine, prompts, args.group, args.tokens)
    batched_tokens = args.prompts * args.group * args.tokens
    rate = {
        "engine": batched_tokens * args.reps / sum(sides["engine"]),
        "service": service_tokens / service_s,
        "engine_eos": eos_tokens / eos_s,
        "loop": len(subset) * args.tokens * args.reps / sum(sides["loop"]),
    }
    return {
        "model": str(model_dir),
        "torch_threads": args.threads,
        "prompts": args.prompts,
        "group": args.group,
        "tokens_per_sample": args.tokens,
        "reps": args.reps,
        "batched_engine": {
            "samples": args.prompts * args.group,
            "seconds": sides["engine"],
            "tokens_per_s": rate["engine"],
        },
        "service_grpc": {
            "calls": args.prompts,
            "seconds": service_s,
            "tokens": service_tokens,
            "tokens_per_s": rate["service"],
            "note": "GenerateGroup has no ignore_eos: samples stop at EOS; compare "
            "with batched_engine_stop_at_eos",
        },
        "batched_engine_stop_at_eos": {
            "seconds": eos_s,
            "tokens": eos_tokens,
            "tokens_per_s": rate["engine_eos"],
        },
        "one_at_a_time_generate": {
            "samples_measured": len(subset),
            "seconds": sides["loop"],
            "tokens_per_s": rate["loop"],
            "note": f"HF model.generate, one sample per call, on the first {len(subset)} of "
            f"the {args.prompts * args.group} samples",
        },
        "speedup": rate["engine"] / rate["loop"],
        "service_vs_engine_stop_at_eos": rate["service"] / rate["engine_eos"],
    }


# -- weight updates --------------------------------------------------------------------


def build_big_model(directory: Path, tokenizer_dir: Path) -> float:
    """A random Qwen2 of >= 100 MB saved in `directory` (tokenizer borrowed); its MB."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**BIG_MODEL))
    model.save_pretrained(directory)
    for item in tokenizer_dir.iterdir():
        if "token" in item.name or item.name == "chat_template.jinja":
            shutil.copy(item, directory / item.name)
    return sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6


def new_weights(engine: Any, seed: int) -> list[Any]:
    """Every parameter replaced by noise, as the learner's snapshot would hold them."""
    import torch

    from services.weight_transport.torch_codec import from_torch

    gen = torch.Generator().manual_seed(seed)
    return [
        from_torch(name, torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.02)
        for name, p in engine.model.named_parameters()
    ]


def time_pull(server: Any, learner: Any, client: Any, raws: list[Any], version: int) -> float:
    """From the learner publishing a version to the rollout server serving it."""
    from services.common.keys import RunKeys

    start = time.perf_counter()
    learner.publish(version, raws)
    client.set(RunKeys(server.config.shared.run_name).version, version)
    while server.engine.version < version:
        if time.perf_counter() - start > 600:
            raise RuntimeError("pull did not finish")
        time.sleep(0.002)
    return time.perf_counter() - start


def start_learner(client: Any, run: str, bucket_bytes: int) -> tuple[Any, Any, Any]:
    from learner.weights import WeightServicer, add_weight_service
    from services.common.grpc_server import start_grpc_server
    from services.common.keys import RunKeys
    from services.common.registry import Registration
    from services.common.server_config import ServerConfig

    servicer = WeightServicer(bucket_bytes)
    server, port = start_grpc_server(
        ServerConfig(),
        lambda s: add_weight_service(servicer, s),
        ["dapo.v1.WeightService"],
    )
    info = {"address": f"127.0.0.1:{port}"}
    registration = Registration(client, RunKeys(run), "learner", "bench", info).start()
    return servicer, server, registration


def measure_updates(big_dir: Path, model_mb: float, reps: int, bucket_mb: int) -> dict[str, Any]:
    """Pull reps against one rollout server over the big model."""
    import redis

    from rollout.server import RolloutServer
    from rollout.torch_engine import TorchEngine
    from services.common.redis_server import start_redis
    from services.tools.config import DapoConfig

    bucket_bytes = bucket_mb * 1024 * 1024
    config = DapoConfig.model_validate(
        {
            "shared": {"run_name": "bench-rollout"},
            "rollout": {"server": {"grpc_port": 0, "http_port": 0}, "weight_poll_s": 0.01},
        }
    )
    redis_server = start_redis()
    client = redis.Redis.from_url(redis_server.url)
    learner, learner_server, registration = start_learner(client, "bench-rollout", bucket_bytes)
    engine = TorchEngine(big_dir, device="cpu")
    server = RolloutServer(config, client, engine).start()
    pull: list[float] = []
    try:
        for rep in range(reps):
            pull.append(time_pull(server, learner, client, new_weights(engine, rep), rep + 1))
    finally:
        server.stop()
        registration.stop()
        learner_server.stop(grace=0)
        redis_server.stop()
    return {
        "model": dict(BIG_MODEL, dtype="float32", megabytes=model_mb),
        "bucket_megabytes": bucket_mb,
        "pull_from_learner": {
            "seconds": pull,
            "median_s": statistics.median(pull),
            "mb_per_s": model_mb / statistics.median(pull),
            "note": "learner publish + Redis version -> new version served "
            "(includes the rollout's version poll, 10 ms)",
        },
    }


# -- report ----------------------------------------------------------------------------


def summarize(sampling: dict[str, Any], updates: dict[str, Any]) -> dict[str, Any]:
    mb = updates["model"]["megabytes"]
    pull = updates["pull_from_learner"]["median_s"]
    return {
        "benchmark": "rollout_engine",
        "description": "torch-engine tokens/s (batched vs one-at-a-time) and weight-update s",
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_average": os.getloadavg(),
        },
        "sampling": sampling,
        "weight_updates": updates,
        "checks": [
            at_least(
                "batched_engine_vs_one_at_a_time_generate", sampling["speedup"], TARGET_SPEEDUP
            ),
            at_least("update_model_megabytes", mb, MIN_MODEL_MB),
            at_most("pull_update_seconds", pull, TARGET_UPDATE_S),
        ],
    }


def main(argv: list[str] | None = None) -> int:
    """Run, write the JSON, print a summary; exit 0 when every check is ok."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=16, help="samples per prompt (G)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens sampled per sample")
    parser.add_argument("--loop-samples", type=int, default=16, help="one-at-a-time subset")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--update-reps", type=int, default=3)
    parser.add_argument("--bucket-mb", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args([] if argv is None else argv)  # `dapo bench` calls main()
    import torch

    torch.set_num_threads(args.threads)
    from learner.init_model import init_model

    with tempfile.TemporaryDirectory(prefix="dapo-bench-rollout-") as tmp:
        tiny = init_model(Path(tmp) / "tiny", preset="tiny", seed=0)
        sampling = measure_sampling(tiny, args)
        big = Path(tmp) / "big"
        mb = build_big_model(big, tiny)
        updates = measure_updates(big, mb, args.update_reps, args.bucket_mb)
    result = summarize(sampling, updates)
    code = write_result(RESULTS, result)
    print(
        f"tokens/s: batched engine {sampling['batched_engine']['tokens_per_s']:.0f}, "
        f"service {sampling['service_grpc']['tokens_per_s']:.0f}, one-at-a-time "
        f"{sampling['one_at_a_time_generate']['tokens_per_s']:.0f} "
        f"(x{sampling['speedup']:.1f}); {mb:.0f} MB update: pull "
        f"{updates['pull_from_learner']['median_s']:.2f}s -> {RESULTS}"
    )
    return code


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
