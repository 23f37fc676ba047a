"""Reward service under load: C concurrent clients, normal plus adversarial items, HTTP and gRPC.

One reward service in this process, C client threads posting batches over HTTP and gRPC,
ordinary items mixed with adversarial and paced heavy ones. Checks: no errors, no wrong
verdicts, p99 latency within timeout_s + C*K*t_item + t_big (per-item costs measured in
a baseline phase of the same run). Writes benchmarks/results/reward_load.json (or --out).
The items and the latency bound's derivation: benchmarks/README.md, "`reward_load`".
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import httpx

from benchmarks._results import at_most, check, result_path, write_result
from dapo.v1 import reward_pb2_grpc
from reward.adapter import proto_from_inputs
from reward.scoring import ScoreInput

RESULTS = result_path("reward_load")
TOWER = "Answer: $9^{9^{9^{9^9}}}$"
BIG = "x" * 1_000_000  # 1 MB: math-verify parses all of it (the rule reads 300 chars)
ODD = ["", "\\boxed{\\boxed{\\boxed{7}}}", "Answer: \\boxed{\\boxed{7}}"]
SURROGATE = "Answer: 7\ud800"  # a lone surrogate: HTTP replaces it with "?"


class Tally:
    """One client's counts; merged at the end. (A plain class: `dapo bench` loads this
    file without registering it in sys.modules, which dataclasses need.)"""

    COUNTS = ("requests", "items", "errors", "wrong_verdicts", "timeouts", "item_errors", "heavy")

    def __init__(self) -> None:
        self.requests = self.items = self.errors = self.wrong_verdicts = 0
        self.timeouts = self.item_errors = self.heavy = 0
        self.latencies: dict[str, list[float]] = {"http": [], "grpc": []}
        self.messages: list[str] = []


class Pacer:
    """At most one heavy item per `interval_s`, across all clients."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s, self._next, self._lock = interval_s, time.monotonic(), threading.Lock()
        self.count = 0

    def take(self) -> str | None:
        with self._lock:
            now = time.monotonic()
            if self.interval_s <= 0 or now < self._next:
                return None
            self._next, self.count = now + self.interval_s, self.count + 1
            return TOWER if self.count % 2 else BIG


def batch(client: int, n: int, k: int, pacer: Pacer | None, http: bool) -> list[tuple[Any, ...]]:
    """K (response, gold, expected verdict or None) items; None = adversarial, any verdict."""
    items: list[tuple[Any, ...]] = []
    for j in range(k):
        a = (client * 7919 + n * 31 + j) % 1000
        items.append(
            (f"Working... Answer: {a}", str(a), True)
            if j % 2 == 0
            else (f"Working... Answer: {a + 1}", str(a), False)
        )
    if n % 5 == 0:
        items[-1] = (ODD[n // 5 % len(ODD)], "7", None)
    if http and n % 7 == 0:
        items[0] = (SURROGATE, "7", None)
    heavy = pacer.take() if pacer is not None else None
    if heavy is not None:
        items[1] = (heavy, "7", None)
    return items


def nodelay_http(base_url: str) -> httpx.Client:
    """httpx writes headers and body apart; without TCP_NODELAY each POST waits ~40 ms."""
    options = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]
    transport = httpx.HTTPTransport(socket_options=options)
    return httpx.Client(base_url=base_url, timeout=120, transport=transport)


def send(
    transport: str, items: list[tuple[Any, ...]], http: httpx.Client, stub: Any
) -> list[dict[str, Any]]:
    """Score one batch; results as dicts with id, correct, error. Raises on any failure."""
    inputs = [ScoreInput(r, g, id=str(i)) for i, (r, g, _) in enumerate(items)]
    if transport == "http":
        body = {
            "items": [
                {"id": x.id, "response": x.response, "ground_truth": x.ground_truth} for x in inputs
            ]
        }
        reply = http.post("/v1/score", content=json.dumps(body).encode())
        if reply.status_code != 200:
            raise RuntimeError(f"HTTP {reply.status_code}: {reply.text[:200]}")
        return reply.json()["results"]
    response = stub.Score(proto_from_inputs(inputs), timeout=120)
    return [{"id": r.id, "correct": r.correct, "error": r.error} for r in response.results]


def tally_replies(
    items: list[tuple[Any, ...]], results: list[dict[str, Any]], tally: Tally
) -> None:
    """Count one reply's timeouts, item errors and wrong verdicts; raise if it lost an item."""
    if [r["id"] for r in results] != [str(i) for i in range(len(items))]:
        raise RuntimeError(f"results out of order or missing: {len(results)}/{len(items)}")
    for (response, _, expected), result in zip(items, results, strict=True):
        tally.timeouts += result["error"].startswith("timeout")
        tally.item_errors += bool(result["error"])
        tally.heavy += response in (TOWER, BIG)
        if expected is not None and result["correct"] != expected:
            tally.wrong_verdicts += 1


def client_loop(
    index: int, urls: tuple[str, str], stop: threading.Event, k: int, pacer: Pacer | None
) -> Tally:
    tally = Tally()
    with nodelay_http(urls[0]) as http, grpc.insecure_channel(urls[1]) as channel:
        stub = reward_pb2_grpc.RewardServiceStub(channel)
        n = 0
        while not stop.is_set():
            transport = "http" if (n + index) % 2 == 0 else "grpc"
            items = batch(index, n, k, pacer, transport == "http")
            start = time.perf_counter()
            try:
                tally_replies(items, send(transport, items, http, stub), tally)
            except Exception as exc:  # counted: the target is zero
                tally.errors += 1
                tally.messages.append(f"{transport}: {exc}"[:300])
            tally.latencies[transport].append(time.perf_counter() - start)
            tally.requests += 1
            tally.items += len(items)
            n += 1
    return tally


def run_clients(server: Any, clients: int, seconds: float, k: int, pacer: Pacer | None) -> Tally:
    """C client threads for `seconds`; their merged tally."""
    urls = (f"http://127.0.0.1:{server.http_port}", f"127.0.0.1:{server.grpc_port}")
    stop, tallies = threading.Event(), [Tally() for _ in range(clients)]

    def worker(i: int) -> None:
        tallies[i] = client_loop(i, urls, stop, k, pacer)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    return merge(tallies)


def merge(tallies: list[Tally]) -> Tally:
    total = Tally()
    for t in tallies:
        for name in Tally.COUNTS:
            setattr(total, name, getattr(total, name) + getattr(t, name))
        for transport, values in t.latencies.items():
            total.latencies[transport].extend(values)
        total.messages.extend(t.messages)
    return total


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def latency(values: list[float]) -> dict[str, float]:
    mean = statistics.fmean(values) if values else 0.0
    return {
        "p50_s": round(percentile(values, 0.5), 4),
        "p99_s": round(percentile(values, 0.99), 4),
        "max_s": round(max(values, default=0.0), 4),
        "mean_s": round(mean, 4),
    }


def start(workers: int, timeout_s: float) -> Any:
    from reward.server import create_server
    from services.tools.config import DapoConfig

    config = DapoConfig.model_validate(
        {
            "reward": {
                "num_workers": workers,
                "timeout_s": timeout_s,
                "server": {"grpc_port": 0, "http_port": 0},
            }
        }
    )
    server = create_server(config).start()
    if not server.scorer.pool.wait_ready(120):
        raise RuntimeError("reward workers did not start")
    return server


def measure_big(server: Any) -> float:
    """Seconds one 1 MB item takes through the pool (idle), the t_big of the target."""
    from reward.scoring import ScoreInput as Item

    started = time.perf_counter()
    server.scorer.score([Item(BIG, "7")])
    return time.perf_counter() - started


def summarize(
    args: argparse.Namespace,
    base: Tally,
    base_s: float,
    load: Tally,
    t_big: float,
    loads: dict[str, Any],
) -> dict[str, Any]:
    t_item = base_s * args.workers / max(1, base.items)
    target = args.timeout_s + args.clients * args.items * t_item + t_big
    everything = load.latencies["http"] + load.latencies["grpc"]
    p99 = percentile(everything, 0.99)
    checks = [
        at_most("errors", load.errors, 0),
        at_most("wrong_verdicts", load.wrong_verdicts, 0),
        check("p99_latency_s", p99, round(target, 3), p99 <= target),
    ]
    return {
        "benchmark": "reward_load",
        "config": {**vars(args), "out": str(args.out)},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), **loads},
        "baseline": {
            "seconds": round(base_s, 2),
            "requests": base.requests,
            "items": base.items,
            "errors": base.errors,
            "t_item_s": round(t_item, 5),
            "items_per_s": round(base.items / base_s, 1),
        },
        "t_big_s": round(t_big, 3),
        "requests": load.requests,
        "items": load.items,
        "errors": load.errors,
        "error_messages": load.messages[:10],
        "wrong_verdicts": load.wrong_verdicts,
        "timeouts": load.timeouts,
        "item_errors": load.item_errors,
        "heavy_items": load.heavy,
        "latency": {
            "all": latency(everything),
            "http": latency(load.latencies["http"]),
            "grpc": latency(load.latencies["grpc"]),
        },
        "throughput": {
            "requests_per_s": round(load.requests / args.duration, 1),
            "items_per_s": round(load.items / args.duration, 1),
        },
        "target_p99_s": {
            "value": round(target, 3),
            "formula": "timeout_s + clients*items*t_item + t_big",
        },
        "checks": checks,
    }


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dapo bench reward_load", description=__doc__.split("\n")[0])
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--items", type=int, default=4, help="items per request")
    p.add_argument("--timeout-s", type=float, default=5.0, help="per-item hard timeout")
    p.add_argument("--baseline-s", type=float, default=5.0, help="ordinary-traffic phase")
    p.add_argument("--out", type=Path, default=RESULTS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    server = start(args.workers, args.timeout_s)
    try:
        t_big = measure_big(server)
        base = run_clients(server, args.clients, args.baseline_s, args.items, None)
        before = os.getloadavg()
        load = run_clients(server, args.clients, args.duration, args.items, Pacer(args.timeout_s))
        after = os.getloadavg()
    finally:
        server.stop()
    loads = {
        "loadavg_before": [round(x, 2) for x in before],
        "loadavg_after": [round(x, 2) for x in after],
    }
    result = summarize(args, base, args.baseline_s, load, t_big, loads)
    return write_result(args.out, result)
