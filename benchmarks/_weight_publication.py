"""Part 3 of benchmarks/learner_step.py: weight publication (see its docstring and
docs/weight_publication.md). Run as `python -m benchmarks._weight_publication BUCKET_BYTES
[--no-malloc-tuning]` from the repository root, it is the publisher process: a learner
stand-in in its own process, as the learner is. (Underscored: not a `dapo bench` name.)
"""

from __future__ import annotations

import socket
import statistics
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def big_model_tensors() -> tuple[list[Any], int]:
    """A random Qwen2 of ≥ 100 MB (fp32): views of its weights, as the learner publishes."""
    from benchmarks._models import random_qwen2
    from learner.init_model import ModelShape
    from learner.weights import live_views

    model = random_qwen2(12000, ModelShape(512, 1536, 6, 8, 4, 32768, False), seed=0)
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


def serve_raw(tensors: list[Any]) -> socket.socket:
    """A listener that sends the tensors' raw bytes to every connection (the baseline)."""
    listener = socket.create_server(("127.0.0.1", 0))

    def raw_sender() -> None:
        while True:
            conn, _ = listener.accept()
            with conn:
                send_all(conn, tensors)

    threading.Thread(target=raw_sender, daemon=True, name="raw-sender").start()
    return listener


def serve_publication(bucket_bytes: int) -> None:
    """The publisher process (this module's __main__), a learner stand-in: the WeightService
    and a raw TCP sender of the same bytes; `publish V` on stdin publishes a version."""
    import sys

    from learner.weights import WeightServicer, add_weight_service
    from services.common.grpc_server import start_grpc_server
    from services.common.security import TlsConfig
    from services.common.server_config import ServerConfig
    from services.weight_transport.weight_socket import WeightSocketServer

    tensors, nbytes = big_model_tensors()
    weight_socket = WeightSocketServer("127.0.0.1", 0, TlsConfig()).start()
    servicer = WeightServicer(bucket_bytes, weight_socket)
    server, grpc_port = start_grpc_server(
        ServerConfig(), lambda s: add_weight_service(servicer, s), ["dapo.v1.WeightService"]
    )
    listener = serve_raw(tensors)
    print("ready", grpc_port, listener.getsockname()[1], nbytes, flush=True)
    for line in sys.stdin:
        version = int(line.split()[1])
        started = time.perf_counter()
        servicer.publish(version, tensors)
        print("published", version, time.perf_counter() - started, flush=True)
    server.stop(0)


def fetch_seconds(channel: Any, nbytes: int, transport: str) -> float:
    """One fetch as a rollout server runs it, over the weight socket (`socket_buckets`)
    or the FetchWeights stream: received in place (parsed in place, assembled), to torch."""
    from dapo.v1 import learner_pb2
    from rollout.weights import WeightStub, socket_buckets
    from services.tools.config import DapoConfig
    from services.weight_transport.assembly import Assembling, assemble_update
    from services.weight_transport.torch_codec import to_torch

    started = time.perf_counter()
    stub = WeightStub(channel)
    if transport == "socket":
        buckets = socket_buckets(stub, "127.0.0.1:0", DapoConfig())
        assert buckets is not None, "the publisher offered no weight socket"
    else:
        buckets = Assembling(stub.FetchWeights(learner_pb2.FetchWeightsRequest()))
    out = [to_torch(t) for t in assemble_update(buckets)[1]]
    seconds = time.perf_counter() - started
    assert sum(t.numel() * t.element_size() for t in out) == nbytes
    return seconds


def publish_and_fetch(bucket_bytes: int, versions: int, tuned: bool) -> dict[str, Any]:
    """Per version, against a publisher in its own process (as the learner is): raw TCP,
    then `publish` (copy the live weights into a snapshot), then two fetches over loopback gRPC
    (the first rollout server, and every further one)."""
    import subprocess
    import sys

    from services.common.grpc_server import insecure_channel
    from services.common.server_config import RpcConfig

    module = f"benchmarks.{Path(__file__).stem}"  # run from the repository root (cwd)
    argv = [sys.executable, "-m", module, str(bucket_bytes)]
    publisher = subprocess.Popen(
        argv + ([] if tuned else ["--no-malloc-tuning"]),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    assert publisher.stdin and publisher.stdout
    _, grpc_port, tcp_port, nbytes = publisher.stdout.readline().split()
    nbytes = int(nbytes)
    runs: dict[str, Any] = {
        "publish_s": [],
        "fetch_s": [],
        "repeat_fetch_s": [],
        "grpc_fetch_s": [],
        "tcp": [],
    }
    try:
        with insecure_channel(f"127.0.0.1:{grpc_port}", RpcConfig().max_message_bytes) as ch:
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

    bucket = bucket or LearnerConfig().publication.bucket_bytes
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
    return {
        "model_bytes": nbytes,
        "publisher": "own process",
        "bucket_bytes": bucket,
        "transport": "weight socket (ticket over gRPC)",
        "versions": versions,
        "total_s": total_s,
        "publish_s": publish_s,
        "raw_tcp_bytes_per_s": tcp,
        "fetch_bytes_per_s": nbytes / fetch_s,
        "repeat_fetch_bytes_per_s": repeat,
        "publish_plus_fetch_bytes_per_s": nbytes / (publish_s + fetch_s),
        "ratio": statistics.median(pairs),
        "paired_ratios": pairs,
        "ratio_of_medians": nbytes / fetch_s / tcp,
        "repeat_ratio": repeat / tcp,
        "publish_plus_fetch_ratio": nbytes / (publish_s + fetch_s) / tcp,
        "grpc_stream_ratio": statistics.median(grpc_pairs),
        "grpc_stream_paired_ratios": grpc_pairs,
        "cold_version_1": {
            "tcp_bytes_per_s": runs["tcp"][0],
            "publish_s": runs["publish_s"][0],
            "fetch_bytes_per_s": nbytes / runs["fetch_s"][0],
        },
        "runs": runs,
    }


if __name__ == "__main__":
    import sys

    from services.common.malloc import keep_freed_memory

    if "--no-malloc-tuning" not in sys.argv:
        keep_freed_memory()
    serve_publication(int(sys.argv[1]))
