"""`dapo bench weights`: a new policy from the learner to 1 and to 4 rollout servers.

A Qwen2.5-0.5B-shaped random model (0.99 GB published) goes from a learner stand-in to R
real rollout servers in a relay chain, each version against a raw loopback TCP copy of
the same bytes in the same run. Checks: with 1 server, ≥ 0.5 × raw; the learner's bytes
with 4 servers ≤ 1.1 × with 1. Run as `python -m benchmarks.weights publisher|server ...`
these are the child processes. Method: benchmarks/README.md, "`weights`".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import _weight_publication
from benchmarks._results import check, result_path, write_result

ROOT = Path(__file__).resolve().parent.parent
RESULTS = result_path("weights")
QWEN25_05B = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    tie_word_embeddings=True,
)


def save_model(out: Path) -> None:
    """The random bf16 model and a tokenizer, saved where every process loads it."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from learner.init_model import build_small_tokenizer

    torch.manual_seed(0)
    with torch.no_grad():
        model = Qwen2ForCausalLM(Qwen2Config(**QWEN25_05B)).to(torch.bfloat16)
    model.save_pretrained(out)
    build_small_tokenizer().save_pretrained(out)


def serve_publisher(model_dir: str, background: bool = True) -> None:
    """The learner stand-in, publishing as `dapo learner` does by default
    (`learner.publication.in_background`, weights copied in the background): `publish V` on
    stdin replies once the step would go on (at once: the copy and the offer run in a
    thread); `wire` waits for it to be served and replies with the bytes one stream
    sends; `streams` counts the streams served."""

    import torch
    from transformers import AutoModelForCausalLM

    from learner.model_io import unique_weights
    from learner.publisher import BackgroundPublisher
    from learner.weights import WeightServicer, add_weight_service, live_views
    from services.common.grpc_server import start_grpc_server
    from services.common.process import configure_process
    from services.common.security import TlsConfig
    from services.common.server_config import ServerConfig
    from services.weight_transport.weight_socket import WeightSocketServer

    setup = configure_process("learner", None)  # as `dapo learner` does
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    tensors = live_views((n, t.detach()) for n, t in unique_weights(model))
    streams = [0]

    class CountingServicer(WeightServicer):
        def OpenWeightSocket(self, request, context):  # noqa: N802 (gRPC's name)
            streams[0] += 1
            return super().OpenWeightSocket(request, context)

        def fetch_serialized(self, request, context):  # FetchWeights' handler
            streams[0] += 1
            return super().fetch_serialized(request, context)

    servicer = CountingServicer(4 << 20, WeightSocketServer("127.0.0.1", 0, TlsConfig()).start())
    publisher = BackgroundPublisher(servicer)
    server, grpc_port = start_grpc_server(
        ServerConfig(), lambda s: add_weight_service(servicer, s), ["dapo.v1.WeightService"]
    )
    listener = _weight_publication.serve_raw(tensors)
    nbytes = sum(len(t.data) for t in tensors)
    print("ready", grpc_port, listener.getsockname()[1], nbytes, json.dumps(setup), flush=True)
    for line in sys.stdin:
        command, version = line.split()
        if command == "publish" and background:
            publisher.submit(int(version), tensors, len(tensors), overlap=True)
            print("published", version, flush=True)
        elif command == "publish":  # learner.publication.in_background: false
            servicer.publish(int(version), tensors)
            print("published", version, flush=True)
        elif command == "wire":
            publisher.wait()
            assert servicer._encoded is not None
            print("wire", servicer._encoded.nbytes(), flush=True)
        else:
            print("streams", streams[0], flush=True)
    server.stop(0)


def serve_rollout(
    model_dir: str, grpc_port: str, index: int, parent_relay: int, device: str = "cpu"
) -> None:
    """One rollout server: a torch engine and its relay; `fetch` on stdin pulls the latest
    (from the previous server's relay when `parent_relay`, else the learner) and loads it."""
    from rollout.metrics import RolloutMetrics
    from rollout.server import start_relay
    from rollout.torch_engine import TorchEngine
    from rollout.weights import RelaySource, WeightStub, WeightUpdater, learner_sources, pull
    from services.common.grpc_server import insecure_channel
    from services.common.process import configure_process
    from services.tools.config import DapoConfig

    configure_process("rollout", None)  # as `dapo rollout` does
    engine = TorchEngine(model_dir, dtype="bfloat16", device=device)
    updater, config = WeightUpdater(engine, RolloutMetrics()), DapoConfig()
    relay = start_relay(config)
    assert relay is not None
    address = f"127.0.0.1:{grpc_port}"
    parent = {"address": "127.0.0.1:0", "relay": parent_relay}
    print("ready", relay.port, flush=True)
    with insecure_channel(address, config.shared.rpc.max_message_bytes) as channel:
        for line in sys.stdin:
            wait_offered(WeightStub(channel), int(line.split()[1]))
            sources = learner_sources(WeightStub(channel), address, config, relay.hub)
            if parent_relay:  # the chain's order, as the registry would give it
                source = RelaySource(parent, index, engine.version + 1, relay.hub, config)
                sources.insert(0, source)
            transport, version = pull(sources, updater)
            print("served", version, transport, flush=True)


def wait_offered(stub: Any, version: int) -> None:
    """Until the learner offers `version`, as a rollout server that saw it committed
    waits (`WeightSync`): background publication offers it a moment after the step."""
    from dapo.v1 import learner_pb2

    while stub.GetVersion(learner_pb2.GetVersionRequest(), timeout=10).version < version:
        time.sleep(0.005)  # a tighter poll takes the learner's CPU while it snapshots


def _spawn(*args: str) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "benchmarks.weights", *args]
    return subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT
    )


def _ask(proc: subprocess.Popen[str], line: str) -> list[str]:
    assert proc.stdin and proc.stdout
    proc.stdin.write(line + "\n")
    proc.stdin.flush()
    return proc.stdout.readline().split()


def fan_out(
    publisher: subprocess.Popen[str],
    servers: list[subprocess.Popen[str]],
    version: int,
    tcp_port: int,
    nbytes: int,
) -> dict[str, Any]:
    """One version: the raw copy, then publish → every server serving it."""
    raw_bps = _weight_publication.raw_tcp_bytes_per_s(tcp_port, nbytes)
    streams_before = int(_ask(publisher, "streams 0")[1])
    started = time.perf_counter()
    _ask(publisher, f"publish {version}")
    for proc in servers:
        assert proc.stdin
        proc.stdin.write(f"fetch {version}\n")
        proc.stdin.flush()
    replies = [proc.stdout.readline().split() for proc in servers if proc.stdout]
    seconds = time.perf_counter() - started
    wire = int(_ask(publisher, "wire 0")[1])
    assert all(r[:2] == ["served", str(version)] for r in replies), replies
    streams = int(_ask(publisher, "streams 0")[1]) - streams_before
    transports = sorted({" ".join(r[2:]) for r in replies})
    return {
        "seconds": seconds,
        "raw_bytes_per_s": raw_bps,
        "learner_bytes": streams * wire,
        "ratio": nbytes / seconds / raw_bps,
        "transports": transports,
    }


def run(
    model_dir: Path, fan_outs: list[int], versions: int, sync: bool, device: str = "cpu"
) -> dict[str, Any]:
    """Publish `versions` versions to each fan-out of rollout servers (engines on `device`)."""
    publisher = _spawn("publisher", str(model_dir), *(["sync"] if sync else []))
    assert publisher.stdout
    _, grpc_port, tcp_port, nbytes, setup = publisher.stdout.readline().split(maxsplit=4)
    results: dict[str, Any] = {"model_bytes": int(nbytes), "learner_process": json.loads(setup)}
    version = 0
    try:
        for count in fan_outs:
            servers: list[subprocess.Popen[str]] = []
            try:
                relay_port = "0"
                for index in range(count):
                    servers.append(
                        _spawn("server", str(model_dir), grpc_port, str(index), relay_port, device)
                    )
                    ready, relay_port = servers[-1].stdout.readline().split()  # type: ignore[union-attr]
                    assert ready == "ready"
                runs = []
                for _ in range(versions):
                    version += 1
                    runs.append(fan_out(publisher, servers, version, int(tcp_port), int(nbytes)))
                    print(f"{count} server(s), v{version}: {runs[-1]}", flush=True)
            finally:
                for p in servers:
                    p.kill()
                    p.wait()
            results[f"servers_{count}"] = summary(runs)
    finally:
        publisher.kill()
        publisher.wait()
    return results


WARM_UP = 2  # versions whose memory is new: the publisher's two snapshot buffers


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the steady versions, each paired with the raw copy measured just before
    it. The first two versions are reported as `cold`: every page they touch is new (the
    learner's double-buffered snapshot fills one buffer per version; a rollout server
    frees the weights it received only when the next version replaces them), and a fresh
    page costs about 2 s per GB here (in-process profile: the snapshot into a new
    buffer took 2.81 s, into a reused one 0.17 s)."""
    steady = runs[WARM_UP:] or runs
    return {
        "seconds": statistics.median(r["seconds"] for r in steady),
        "raw_bytes_per_s": statistics.median(r["raw_bytes_per_s"] for r in steady),
        "ratio": statistics.median(r["ratio"] for r in steady),
        "learner_bytes": statistics.median(r["learner_bytes"] for r in steady),
        "cold": runs[:WARM_UP],
        "runs": runs,
    }


def checks(result: dict[str, Any]) -> list[dict[str, Any]]:
    one, four = result["servers_1"], result.get("servers_4")
    out = [check("one_server_vs_raw_loopback", one["ratio"], ">= 0.5", one["ratio"] >= 0.5)]
    if four is not None:
        growth = four["learner_bytes"] / one["learner_bytes"]
        out.append(check("learner_bytes_4_over_1", growth, "<= 1.1", growth <= 1.1))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", default="1,4", help="fan-outs to measure")
    parser.add_argument(
        "--versions", type=int, default=5, help="versions per fan-out (the first 2: cold)"
    )
    parser.add_argument(
        "--sync-publish",
        action="store_true",
        help="publish inside the step (learner.publication.in_background: false)",
    )
    args = parser.parse_args(argv or [])
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dapo-bench-weights-") as tmp:
        save_model(Path(tmp))
        result = run(
            Path(tmp), [int(n) for n in args.servers.split(",")], args.versions, args.sync_publish
        )
    result["publication"] = "in the step (sync)" if args.sync_publish else "background"
    result |= {
        "total_s": time.perf_counter() - started,
        "load_avg_1m": os.getloadavg()[0],
        "cpus": os.cpu_count(),
        "checks": checks(result),
    }
    return write_result(RESULTS, result)


if __name__ == "__main__":
    if sys.argv[1] == "publisher":
        serve_publisher(sys.argv[2], background=sys.argv[3:] != ["sync"])
    else:
        serve_rollout(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), *sys.argv[6:])
