"""Reward throughput: the service (gRPC batch, 2 workers) against a plain in-process loop.

Both score the same fresh items with the default `cascade` verifier, both warm, no
verdict cache; the median of the per-repetition ratios is the result. Target on a quiet
2-core machine: >= 1.8x. Writes benchmarks/results/reward_throughput.json. The items and
what is recorded: benchmarks/README.md, "`reward_throughput`".
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks._results import at_least, check, result_path, write_result
from services.common.data import aime_path

RESULTS = result_path("reward_throughput")
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
    from services.tools.config import DapoConfig

    config = DapoConfig.model_validate(
        {"reward": {"num_workers": workers, "server": {"grpc_port": 0, "http_port": 0}}}
    )
    server = create_server(config).start()
    if not server.scorer.pool.wait_ready(120):
        server.stop()
        raise RuntimeError("reward workers did not start")
    return server


def pids_cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of these processes so far (Linux /proc; 0 elsewhere)."""
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def inprocess_side(items: list[tuple[str, str]], soft: int) -> dict[str, Any]:
    cpu0 = time.process_time()
    seconds, verdicts = run_inprocess(items, soft)
    return {"inprocess_s": seconds, "inprocess_cpu_s": time.process_time() - cpu0, "v": verdicts}


def service_side(server: Any, stub: Any, items: list[tuple[str, str]]) -> dict[str, Any]:
    from reward.metrics import sample_value

    pids = server.scorer.pool.worker_pids()
    busy0, cpu0, workers0 = (
        sample_value("dapo_reward_verify_seconds_sum"),
        time.process_time(),
        pids_cpu_s(pids),
    )
    seconds, verdicts = run_service(stub, items)
    return {
        "grpc_s": seconds,
        "service_process_cpu_s": time.process_time() - cpu0,
        "worker_busy_s": sample_value("dapo_reward_verify_seconds_sum") - busy0,
        "worker_cpu_s": pids_cpu_s(pids) - workers0,
        "w": verdicts,
    }


def measure_rep(server: Any, stub: Any, items: list[tuple[str, str]], rep: int) -> dict[str, Any]:
    """One repetition: both sides on the same items; which goes first alternates, so a
    drift in machine load does not always hit the same side."""
    load_before = os.getloadavg()[0]
    sides = [
        lambda: inprocess_side(items, server.scorer.pool.soft_timeout_s),
        lambda: service_side(server, stub, items),
    ]
    record: dict[str, Any] = {}
    for side in sides if rep % 2 == 0 else sides[::-1]:
        record.update(side())
    local, remote = record.pop("v"), record.pop("w")
    record["agree"] = sum(a == b for a, b in zip(local, remote, strict=True))
    record["items"] = len(items)
    record["load_1min"] = [load_before, os.getloadavg()[0]]
    return record


def measure(items_per_rep: int, reps: int, workers: int) -> dict[str, Any]:
    """Interleave the two sides per repetition so machine noise hits both alike; the
    first repetition only warms both up (sympy caches, gRPC channel) and is not counted."""
    from dapo.v1 import reward_pb2_grpc
    from reward.preload import warm_up
    from services.common.grpc_server import insecure_channel

    warm_up()
    golds, source = gold_answers()
    server = start_service(workers)
    try:
        with insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
            stub = reward_pb2_grpc.RewardServiceStub(channel)
            run_service(stub, make_items(golds, 2 * workers, 100_000))  # connect
            records = [
                measure_rep(server, stub, make_items(golds, items_per_rep, rep * 1000), rep)
                for rep in range(reps + 1)
            ]
    finally:
        server.stop()
    return summarize(records[1:], workers, source, records[0])


def per_item(records: list[dict[str, Any]], key: str) -> float:
    """Seconds per item of one measured quantity over all counted repetitions."""
    return sum(r[key] for r in records) / sum(r["items"] for r in records)


def costs(records: list[dict[str, Any]], workers: int) -> dict[str, Any]:
    """Where the time goes, per item, and how busy the workers were."""
    inprocess, busy = per_item(records, "inprocess_s"), per_item(records, "worker_busy_s")
    return {
        "inprocess_s_per_item": inprocess,
        "inprocess_cpu_s_per_item": per_item(records, "inprocess_cpu_s"),
        "worker_busy_s_per_item": busy,
        "worker_cpu_s_per_item": per_item(records, "worker_cpu_s"),
        "service_process_cpu_s_per_item": per_item(records, "service_process_cpu_s"),
        "worker_busy_vs_inprocess": busy / inprocess,
        # A model, not a measurement: the ratio a quiet machine with `workers` free cores
        # would allow given the measured CPU per item (ignores idle gaps and the tail).
        "cpu_cost_bound_speedup": workers
        * per_item(records, "inprocess_cpu_s")
        / (per_item(records, "worker_cpu_s") + per_item(records, "service_process_cpu_s")),
        "worker_utilisation": sum(r["worker_busy_s"] for r in records)
        / (workers * sum(r["grpc_s"] for r in records)),
        "note": "busy = wall time inside the verifier, as the workers report it; cpu from "
        "/proc (10 ms ticks). service_process = gRPC server, dispatcher and this client.",
    }


def summarize(
    records: list[dict[str, Any]], workers: int, source: str, warmup: dict[str, Any]
) -> dict[str, Any]:
    """The check uses the median of the per-repetition ratios, which a burst of load from
    other processes on a shared machine moves least."""
    n, reps = records[0]["items"], len(records)
    pairs = [r["inprocess_s"] / r["grpc_s"] for r in records]
    speedup = statistics.median(pairs)
    agreement = sum(r["agree"] for r in records) / sum(r["items"] for r in records)
    rate = {side: n * reps / sum(r[f"{side}_s"] for r in records) for side in ("inprocess", "grpc")}
    return {
        "benchmark": "reward_throughput",
        "description": "cascade verifications/s: gRPC batch through the service vs in-process",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "inputs": {
            "golds": source,
            "items_per_rep": n,
            "reps": reps,
            "warmup_reps_excluded": 1,
            "verifier": "cascade",
            "caching": "no verdict cache anywhere; every repetition uses distinct items",
        },
        "workers": workers,
        "inprocess": {
            "seconds": [r["inprocess_s"] for r in records],
            "verifications_per_s": rate["inprocess"],
        },
        "grpc_batch": {
            "seconds": [r["grpc_s"] for r in records],
            "verifications_per_s": rate["grpc"],
        },
        "speedup_per_rep": pairs,
        "speedup": speedup,
        "speedup_of_totals": rate["grpc"] / rate["inprocess"],
        "costs": costs(records, workers),
        "load_average_1min_per_rep": [r["load_1min"] for r in records],
        "load_average_after": os.getloadavg(),
        "warmup_rep": {k: warmup[k] for k in ("inprocess_s", "grpc_s")},
        "verdict_agreement": agreement,
        "checks": [
            at_least(f"grpc_batch_{workers}_workers_vs_inprocess_loop", speedup, TARGET_SPEEDUP),
            check(
                "verdicts_identical_service_vs_inprocess",
                agreement,
                1.0,
                agreement == 1.0,
                digits=6,
            ),
        ],
    }


def main(argv: list[str] | None = None) -> int:
    """Run, write the JSON, print a summary; exit 0 when every check is ok."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=300, help="items per repetition")
    parser.add_argument("--reps", type=int, default=7, help="counted, after one warm-up")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    result = measure(args.items, args.reps, args.workers)
    code = write_result(RESULTS, result)
    print(
        f"in-process {result['inprocess']['verifications_per_s']:.0f}/s, "
        f"gRPC batch ({args.workers} workers) {result['grpc_batch']['verifications_per_s']:.0f}/s, "
        f"median speedup {result['speedup']:.2f}x (target {TARGET_SPEEDUP}x), "
        f"agreement {result['verdict_agreement']:.3f}, "
        f"worker utilisation {result['costs']['worker_utilisation']:.2f}, "
        f"load {result['load_average_after'][0]:.1f} -> {RESULTS}"
    )
    return code


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
