"""Reward throughput: the service (gRPC batch, 2 workers) against a plain in-process loop.

Both score the same items with the default `cascade` verifier: AIME-2024 answers (or
0..999 when the shared file is absent) dressed in formats most of which the paper's
rule rejects, so math-verify does the work, as it does for real equivalent answers.
Every repetition uses a fresh item set, so neither side profits from math-verify's
parse caches, and both start warm (math-verify imported and used once).

Writes benchmarks/results/reward.json with the measured rates, their ratio, and the
agreement of the two sides' verdicts. Target on a 2-core machine: >= 1.8x.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from services.common.data import aime_path

RESULTS = Path(__file__).resolve().parent / "results" / "reward.json"
AIME = aime_path()
TARGET_SPEEDUP = 1.8
REASONING = "Let me work through the problem step by step, checking each case. " * 8


def gold_answers() -> tuple[list[str], str]:
    """The AIME-2024 ground truths, or 0..999 as strings when the file is absent."""
    if AIME.is_file():
        import pyarrow.parquet as pq

        rows = pq.read_table(AIME, columns=["reward_model"]).column("reward_model").to_pylist()
        return sorted({r["ground_truth"] for r in rows}, key=int), str(AIME)
    return [str(n) for n in range(1000)], "synthetic 0..999 (AIME file absent)"


def dress(a: int, k: int) -> str:
    """Answer `a` in one of five formats (k picks one and makes the text unique)."""
    formats = (
        f"Answer: \\frac{{{a * (k + 2)}}}{{{k + 2}}}",  # equivalent, rule says wrong
        f"Answer: {a}.{'0' * (k % 7 + 1)}",  # equivalent decimal
        f"Answer: {a + k + 1}",  # wrong: both checks run
        f"So the final answer is $\\boxed{{{a * (k + 2)}/{k + 2}}}$.",  # no Answer: line
        f"Answer: {a}",  # the rule decides alone
    )
    return f"{REASONING}(attempt {k})\n{formats[k % len(formats)]}"


def make_items(golds: list[str], n: int, offset: int) -> list[tuple[str, str]]:
    """n (response, ground truth) pairs, distinct across offsets."""
    return [
        (dress(int(golds[i % len(golds)]), offset + i // len(golds)), golds[i % len(golds)])
        for i in range(n)
    ]


def run_inprocess(items: list[tuple[str, str]], soft_timeout_s: int) -> tuple[float, list[bool]]:
    """The baseline: one loop in this process's main thread."""
    from reward.verifiers import run_verifier

    start = time.perf_counter()
    verdicts = [run_verifier("cascade", r, g, soft_timeout_s).correct for r, g in items]
    return time.perf_counter() - start, verdicts


def run_service(stub: Any, items: list[tuple[str, str]]) -> tuple[float, list[bool]]:
    """One gRPC Score call with the whole batch."""
    from dapo.v1 import reward_pb2

    request = reward_pb2.ScoreRequest(
        items=[reward_pb2.ScoreItem(response=r, ground_truth=g) for r, g in items]
    )
    start = time.perf_counter()
    reply = stub.Score(request, timeout=600)
    return time.perf_counter() - start, [r.correct for r in reply.results]


def start_service(workers: int) -> Any:
    from reward.server import create_server
    from services.common.config import DapoConfig

    config = DapoConfig.model_validate(
        {"reward": {"num_workers": workers, "server": {"grpc_port": 0, "http_port": 0}}}
    )
    server = create_server(config)
    if not server.scorer.pool.wait_ready(120):
        server.stop()
        raise RuntimeError("reward workers did not start")
    return server


def measure(items_per_rep: int, reps: int, workers: int) -> dict[str, Any]:
    """Interleave the two sides per repetition so machine noise hits both alike."""
    from dapo.v1 import reward_pb2_grpc
    from reward.preload import warm_up
    from services.common.grpc_server import insecure_channel

    warm_up()
    golds, source = gold_answers()
    server = start_service(workers)
    soft = server.scorer.pool.soft_timeout_s
    from reward.metrics import sample_value

    sides: dict[str, list[float]] = {"inprocess": [], "grpc": []}
    agree = total = 0
    cpu = {"service_process_cpu_s": 0.0, "worker_busy_s": 0.0}
    try:
        with insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
            stub = reward_pb2_grpc.RewardServiceStub(channel)
            run_service(stub, make_items(golds, 2 * workers, 10_000))  # connect + warm
            for rep in range(reps):
                items = make_items(golds, items_per_rep, rep * 1000)
                local_s, local = run_inprocess(items, soft)
                busy0, cpu0 = sample_value("dapo_reward_verify_seconds_sum"), time.process_time()
                remote_s, remote = run_service(stub, items)
                cpu["service_process_cpu_s"] += time.process_time() - cpu0
                cpu["worker_busy_s"] += sample_value("dapo_reward_verify_seconds_sum") - busy0
                sides["inprocess"].append(local_s)
                sides["grpc"].append(remote_s)
                agree += sum(a == b for a, b in zip(local, remote, strict=True))
                total += len(items)
    finally:
        server.stop()
    result = summarize(sides, items_per_rep, reps, workers, agree / total, source)
    # The gRPC server, dispatcher and client share this process: its CPU against the
    # workers' busy time is the service's own overhead, whatever the machine's load.
    result["overhead"] = {**cpu, "ratio": cpu["service_process_cpu_s"] / cpu["worker_busy_s"]}
    return result


def summarize(
    sides: dict[str, list[float]], n: int, reps: int, workers: int, agreement: float, source: str
) -> dict[str, Any]:
    """Rates over all repetitions; the check uses the median of the per-repetition ratios,
    which a burst of load from other processes on a shared machine moves least."""
    rate = {name: n * reps / sum(seconds) for name, seconds in sides.items()}
    pairs = [a / b for a, b in zip(sides["inprocess"], sides["grpc"], strict=True)]
    speedup = statistics.median(pairs)
    return {
        "benchmark": "reward",
        "description": "cascade verifications/s: gRPC batch through the service vs in-process",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "inputs": {"golds": source, "items_per_rep": n, "reps": reps, "verifier": "cascade"},
        "workers": workers,
        "inprocess": {"seconds": sides["inprocess"], "verifications_per_s": rate["inprocess"]},
        "grpc_batch": {"seconds": sides["grpc"], "verifications_per_s": rate["grpc"]},
        "speedup_per_rep": pairs,
        "speedup": speedup,
        "speedup_of_totals": rate["grpc"] / rate["inprocess"],
        "load_average_after": os.getloadavg(),
        "verdict_agreement": agreement,
        "checks": [
            {
                "name": f"grpc_batch_{workers}_workers_vs_inprocess_loop",
                "value": round(speedup, 3),
                "target": TARGET_SPEEDUP,
                "ok": speedup >= TARGET_SPEEDUP,
            },
            {
                "name": "verdicts_identical_service_vs_inprocess",
                "value": agreement,
                "target": 1.0,
                "ok": agreement == 1.0,
            },
        ],
    }


def main(argv: list[str] | None = None) -> int:
    """Run, write the JSON, print a summary; exit 0 when every check is ok."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=300, help="items per repetition")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    result = measure(args.items, args.reps, args.workers)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"in-process {result['inprocess']['verifications_per_s']:.0f}/s, "
        f"gRPC batch ({args.workers} workers) {result['grpc_batch']['verifications_per_s']:.0f}/s, "
        f"median speedup {result['speedup']:.2f}x (target {TARGET_SPEEDUP}x), "
        f"agreement {result['verdict_agreement']:.3f} -> {RESULTS}"
    )
    return 0 if all(check["ok"] for check in result["checks"]) else 1


if __name__ == "__main__":
    import sys

    # Run as a script, this file's folder heads sys.path and its name would shadow the
    # `reward` package; drop it (imports of the package happen inside the functions).
    here = str(Path(__file__).resolve().parent)
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(here)]
    raise SystemExit(main())
