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
   Like `dapo learner` / `dapo rollout`, the process tunes glibc malloc first
   (`--no-malloc-tuning` to compare).

Writes benchmarks/results/learner.json (details + `checks`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from services.common.malloc import keep_freed_memory

RESULTS = Path(__file__).resolve().parent / "results" / "learner.json"
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
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from learner.init_model import init_model

    out = init_model(root / "bench", preset="tiny", seed=0)
    config = Qwen2Config(vocab_size=4096, hidden_size=256, intermediate_size=768,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         tie_word_embeddings=True, max_position_embeddings=1024)  # fmt: skip
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(out)
    return out


def plain_torch_step(model: Any, opt: Any, groups: list[Any], cfg: Any) -> float:
    """The baseline: π_old forward, then per mini-batch one padded forward/backward + AdamW."""
    import torch

    from learner.algorithm import agg_loss, per_token_loss
    from learner.batching import collate, mini_batches, sequences_from_groups
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
    cfg = LearnerConfig(engine="deepspeed", zero_stage=0, dtype="float32", lr=1e-5,
                        mini_batch_responses=32, micro_batch_tokens=4096)  # fmt: skip
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
        "learner": {"engine": "deepspeed zero0 fp32", "tokens_per_s": learner_tps,
                    "seconds": learner_s},
        "plain_torch": {"tokens_per_s": plain_tps, "seconds": plain_s},
        "ratio": learner_tps / plain_tps,
    }  # fmt: skip


# ------------------------------------------------------------------ 2. padding
def bench_padding() -> dict[str, Any]:
    from learner.batching import fixed_size_micro_batches, padding_fraction
    from learner.batching import token_budget_micro_batches as budgeted

    lengths = [p + r for p, r in skewed_lengths(512, seed=1)]
    fixed = padding_fraction(lengths, fixed_size_micro_batches(len(lengths), 16))
    by_budget = {b: padding_fraction(lengths, budgeted(lengths, b)) for b in (2048, 4096, 8192)}
    budget = 4096  # the tiny preset's micro_batch_tokens
    return {"rows": len(lengths), "fixed_16_rows": fixed, "token_budget": budget,
            "with_token_budget": by_budget[budget], "by_budget": by_budget}  # fmt: skip


# ------------------------------------------------------------------ 3. publication
def big_model_tensors() -> tuple[list[Any], int]:
    """A random Qwen2 of ≥ 100 MB (fp32): views of its weights, as the learner publishes."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from learner.weights import live_views

    config = Qwen2Config(vocab_size=12000, hidden_size=512, intermediate_size=1536,
                         num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4,
                         tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    with torch.no_grad():
        model = Qwen2ForCausalLM(config)
    tensors = live_views(model.state_dict().items())
    return tensors, sum(len(t.data) for t in tensors)


def send_all(conn: socket.socket, tensors: list[Any]) -> None:
    """The weights' own bytes into one socket, at most 4 MiB per call, no framing."""
    for t in tensors:
        view = memoryview(t.data).cast("B")
        for at in range(0, len(view), 4 << 20):
            conn.sendall(view[at : at + (4 << 20)])


def raw_tcp_bytes_per_s(port: int, nbytes: int) -> float:
    """Loopback TCP from the publisher process: it writes the weights' bytes into one
    socket; we read them into one buffer allocated (and zeroed, so its pages are mapped)
    before the clock starts. The floor of what any transfer of these bytes through the
    kernel between two processes costs."""
    buf = bytearray(nbytes)
    view, got = memoryview(buf), 0
    started = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        while got < nbytes:
            n = sock.recv_into(view[got:], min(nbytes - got, 4 << 20))
            if not n:
                break
            got += n
    seconds = time.perf_counter() - started
    assert got == nbytes, f"raw TCP got {got} of {nbytes} bytes"
    return nbytes / seconds


def serve_publication(bucket_bytes: int) -> None:
    """The publisher process (`--serve-publication`), a learner stand-in: the WeightService
    and a raw TCP sender of the same bytes; `publish V` on stdin publishes a version."""
    import sys

    from learner.weights import WeightServicer, add_weight_service
    from services.common.grpc_server import start_grpc_server
    from services.common.security import TlsConfig
    from services.common.server_config import ServerConfig
    from services.common.weight_socket import WeightSocketServer

    tensors, nbytes = big_model_tensors()
    weight_socket = WeightSocketServer("127.0.0.1", 0, TlsConfig()).start()
    servicer = WeightServicer(bucket_bytes, weight_socket)
    server, grpc_port = start_grpc_server(
        ServerConfig(), lambda s: add_weight_service(servicer, s), ["dapo.v1.WeightService"]
    )
    listener = socket.create_server(("127.0.0.1", 0))

    def raw_sender() -> None:
        while True:
            conn, _ = listener.accept()
            with conn:
                send_all(conn, tensors)

    threading.Thread(target=raw_sender, daemon=True).start()
    print("ready", grpc_port, listener.getsockname()[1], nbytes, flush=True)
    for line in sys.stdin:
        version = int(line.split()[1])
        started = time.perf_counter()
        servicer.publish(version, tensors)
        print("published", version, time.perf_counter() - started, flush=True)
    server.stop(0)


def fetch_seconds(channel: Any, nbytes: int, transport: str) -> float:
    """One fetch as a rollout server runs it, over the weight socket (`socket_buckets`)
    or the FetchWeights stream: parsed in place, assembled, to torch."""
    from dapo.v1 import learner_pb2
    from rollout.weights import WeightStub, socket_buckets
    from services.common.config import DapoConfig
    from services.common.tensor_codec import WeightAssembler, to_torch

    started = time.perf_counter()
    stub, assembler = WeightStub(channel), WeightAssembler()
    if transport == "socket":
        buckets = socket_buckets(stub, "127.0.0.1:0", DapoConfig())
        assert buckets is not None, "the publisher offered no weight socket"
    else:
        buckets = stub.FetchWeights(learner_pb2.FetchWeightsRequest())
    for bucket in buckets:
        assembler.add(bucket)
    out = [to_torch(t) for t in assembler.result()]
    seconds = time.perf_counter() - started
    assert sum(t.numel() * t.element_size() for t in out) == nbytes
    return seconds


def publish_and_fetch(bucket_bytes: int, versions: int, tuned: bool) -> dict[str, Any]:
    """Per version, against a publisher in its own process (as the learner is): raw TCP,
    then `publish` (serialize from the live weights), then two fetches over loopback gRPC
    (the first rollout server, and every further one)."""
    import subprocess
    import sys

    from services.common.grpc_server import insecure_channel
    from services.common.server_config import ServerConfig

    # Loaded by path like `dapo bench` does: run as a script, `import learner` would find
    # this file instead of the package.
    load = (
        "import importlib.util as u, sys; s = u.spec_from_file_location('bench_learner', "
        f"{__file__!r}); m = u.module_from_spec(s); s.loader.exec_module(m); "
        "sys.exit(m.main(sys.argv[1:]))"
    )
    argv = [sys.executable, "-c", load, "--serve-publication", "--bucket-bytes", str(bucket_bytes)]
    publisher = subprocess.Popen(
        argv + ([] if tuned else ["--no-malloc-tuning"]),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=RESULTS.parents[2],
    )  # fmt: skip
    assert publisher.stdin and publisher.stdout
    _, grpc_port, tcp_port, nbytes = publisher.stdout.readline().split()
    nbytes = int(nbytes)
    runs: dict[str, Any] = {
        "publish_s": [], "fetch_s": [], "repeat_fetch_s": [], "grpc_fetch_s": [], "tcp": []
    }  # fmt: skip
    try:
        with insecure_channel(f"127.0.0.1:{grpc_port}", ServerConfig().max_message_bytes) as ch:
            for version in range(1, versions + 1):
                runs["tcp"].append(raw_tcp_bytes_per_s(int(tcp_port), nbytes))
                publisher.stdin.write(f"publish {version}\n")
                publisher.stdin.flush()
                runs["publish_s"].append(float(publisher.stdout.readline().split()[2]))
                runs["fetch_s"].append(fetch_seconds(ch, nbytes, "socket"))
                runs["repeat_fetch_s"].append(fetch_seconds(ch, nbytes, "socket"))
                runs["grpc_fetch_s"].append(fetch_seconds(ch, nbytes, "grpc"))
    finally:
        publisher.stdin.close()
        publisher.wait(timeout=30)
    return runs | {"model_bytes": nbytes}


def paired(nbytes: int, fetch_s: list[float], tcp: list[float]) -> list[float]:
    """Per version: fetch bytes/s over the raw TCP bytes/s measured just before it."""
    return [nbytes / f / t for f, t in zip(fetch_s, tcp, strict=True)]


def bench_publication(versions: int, bucket: int | None, tuned: bool) -> dict[str, Any]:
    """Version 1 runs on a cold process (every page fresh); versions 2..N are the steady
    state of a learner publishing every step, and the check. Each fetch is paired with the
    raw TCP run just before it (same load); the ratio is the median of those pairs."""
    from learner.config import LearnerConfig

    bucket = bucket or LearnerConfig().weight_bucket_bytes
    started = time.perf_counter()
    runs = publish_and_fetch(bucket, versions, tuned)
    nbytes, total_s = runs.pop("model_bytes"), time.perf_counter() - started
    steady = {k: v[1:] for k, v in runs.items()}
    pairs = paired(nbytes, steady["fetch_s"], steady["tcp"])
    tcp = statistics.median(steady["tcp"])
    fetch_s, publish_s = (
        statistics.median(steady["fetch_s"]),
        statistics.median(steady["publish_s"]),
    )
    repeat = nbytes / statistics.median(steady["repeat_fetch_s"])
    grpc_pairs = paired(nbytes, steady["grpc_fetch_s"], steady["tcp"])
    return {"model_bytes": nbytes, "publisher": "own process", "bucket_bytes": bucket,
            "transport": "weight socket (ticket over gRPC)",
            "versions": versions, "total_s": total_s, "publish_s": publish_s,
            "raw_tcp_bytes_per_s": tcp, "fetch_bytes_per_s": nbytes / fetch_s,
            "repeat_fetch_bytes_per_s": repeat,
            "publish_plus_fetch_bytes_per_s": nbytes / (publish_s + fetch_s),
            "ratio": statistics.median(pairs), "paired_ratios": pairs,
            "ratio_of_medians": nbytes / fetch_s / tcp, "repeat_ratio": repeat / tcp,
            "publish_plus_fetch_ratio": nbytes / (publish_s + fetch_s) / tcp,
            "grpc_stream_ratio": statistics.median(grpc_pairs),
            "grpc_stream_paired_ratios": grpc_pairs,
            "cold_version_1": {"tcp_bytes_per_s": runs["tcp"][0],
                               "publish_s": runs["publish_s"][0],
                               "fetch_bytes_per_s": nbytes / runs["fetch_s"][0]},
            "runs": runs}  # fmt: skip


# ------------------------------------------------------------------ main
def checks(thr: dict, pad: dict, pub: dict) -> list[dict[str, Any]]:
    def check(name: str, value: float, target: str, ok: bool) -> dict[str, Any]:
        return {"name": name, "value": round(value, 4), "target": target, "ok": bool(ok)}

    return [
        check("learner_vs_plain_torch_tokens_per_s", thr["ratio"], f">= {TARGET_SPEEDUP}",
              thr["ratio"] >= TARGET_SPEEDUP),
        check("padding_fraction_with_token_budget", pad["with_token_budget"],
              f"<= {TARGET_PADDING}", pad["with_token_budget"] <= TARGET_PADDING),
        check("publication_vs_raw_tcp_bytes_per_s", pub["ratio"], f">= {TARGET_WIRE}",
              pub["ratio"] >= TARGET_WIRE),
        check("publication_model_megabytes", pub["model_bytes"] / 1e6, ">= 100",
              pub["model_bytes"] >= 100e6),
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Run the three benchmarks, write the JSON; 0 when every check is ok."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument(
        "--versions", type=int, default=8, help="weight versions published (1st: cold)"
    )
    parser.add_argument("--serve-publication", action="store_true", help=argparse.SUPPRESS)
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
    if args.serve_publication:
        serve_publication(args.bucket_bytes)
        return 0
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
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "load_avg_1m": os.getloadavg()[0]},
        "throughput": thr, "padding": pad, "publication": pub, "checks": checks(thr, pad, pub),
    }  # fmt: skip
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    for c in result["checks"]:
        print(f"{'ok ' if c['ok'] else 'MISS'} {c['name']}: {c['value']} (target {c['target']})")
    return 0 if all(c["ok"] for c in result["checks"]) else 1


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
