"""Torch rollout engine: batched sampling with a KV cache from a local Hugging Face model.

Runs anywhere (CPU or GPU) and implements `rollout.engine.RolloutEngine` on
`rollout.engine_base.EngineBase`, which owns the version, prompt checks, pause and
weight-swap gating; this module adds the sampler and the in-place weight copy.

How it batches (bucketed, not continuous), what its log-probs mean, how it continues
responses across a weight swap, and why a sample does not depend on its batch-mates:
docs/architecture.md, "The torch rollout engine".
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedModel

from rollout.config import TorchEngineConfig
from rollout.engine import SampleOutput, SamplingParams, StreamedSample
from rollout.engine_base import (
    EngineBase,
    check_weights,
    default_eos,
    refuse_missing,
    stop_ids,
    uncovered,
)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SEED_STRIDE = 1_000_003  # mixes the prompt index into the request seed


def resolve_device(device: str) -> torch.device:
    """'auto' picks CUDA when available, else CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def plan_batches(
    prompt_lengths: Sequence[int], n: int, max_batch_size: int
) -> list[list[tuple[int, int]]]:
    """(prompt index, sample index) rows, sorted by prompt length, in buckets: similar
    lengths together (little padding), a prompt's n rows adjacent (one prefill each)."""
    order = sorted(range(len(prompt_lengths)), key=lambda i: (prompt_lengths[i], i))
    rows = [(i, j) for i in order for j in range(n)]
    return [rows[k : k + max_batch_size] for k in range(0, len(rows), max_batch_size)]


def draw_uniforms(seed: int, prompt_index: int, n: int, max_tokens: int) -> torch.Tensor:
    """The [n, max_tokens] uniforms in [0, 1) of one prompt, reproducible from the seed."""
    gen = torch.Generator().manual_seed((seed * _SEED_STRIDE + prompt_index) % 2**63)
    return torch.rand(n, max_tokens, generator=gen, dtype=torch.float64)


def _truncated_sorted_probs(
    probs: torch.Tensor, top_p: float, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Probabilities sorted descending with the top-k / top-p tail zeroed, and their ids."""
    sorted_probs, sorted_ids = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[-1], device=probs.device)
    drop = torch.zeros_like(sorted_probs, dtype=torch.bool)
    if top_k > 0:
        drop |= rank >= top_k
    if top_p < 1.0:
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop |= (mass_before >= top_p) & (rank > 0)
    return sorted_probs.masked_fill(drop, 0.0), sorted_ids


def sample_next(
    logits: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of `logits` [B, V]; return (token ids, log-probs) [B].

    Log-probs are of the full temperature-scaled distribution (see module docstring).
    """
    logits = logits.float()
    if params.temperature == 0:
        tokens = logits.argmax(-1)
        return tokens, logits.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)
    logprobs = (logits / params.temperature).log_softmax(-1)
    probs = logprobs.exp()
    ids: torch.Tensor | None = None
    if params.top_p < 1.0 or params.top_k > 0:
        probs, ids = _truncated_sorted_probs(probs, params.top_p, params.top_k)
    cdf = probs.cumsum(-1)
    target = (uniforms.to(cdf.dtype) * cdf[:, -1]).unsqueeze(-1)
    picked = torch.searchsorted(cdf, target, right=True).clamp(max=cdf.shape[-1] - 1)
    tokens = (picked if ids is None else ids.gather(-1, picked)).squeeze(-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


def _left_pad(
    prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded input ids and attention mask, both [B, longest]."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
        mask[row, width - len(prompt) :] = 1
    return ids.to(device), mask.to(device)


@dataclass
class _DecodeState:
    """The rows of a bucket still in the batch; every tensor is indexed by batch row.

    Finished rows stay (not `live`, outputs ignored) until they are a quarter of the batch,
    then all are dropped at once: one cache copy per many finishes, not one per finish.
    """

    rows: torch.Tensor  # [B] index of the row in the bucket
    live: torch.Tensor  # [B] still sampling
    cache: DynamicCache
    mask: torch.Tensor  # [B, T] attention mask over cache + next token
    next_pos: torch.Tensor  # [B] position id of the next token
    uniforms: torch.Tensor  # [B, max_tokens]
    logits: torch.Tensor  # [B, V] logits for the next token

    def compact_if_sparse(self) -> None:
        """Drop finished rows from every tensor and the KV cache once they pile up."""
        dead = int((~self.live).sum())
        if dead == 0 or 4 * dead < len(self.live):
            return
        idx = self.live.nonzero().squeeze(-1)
        self.cache.batch_select_indices(idx)
        self.rows, self.live, self.mask = self.rows[idx], self.live[idx], self.mask[idx]
        self.next_pos, self.uniforms = self.next_pos[idx], self.uniforms[idx]
        self.logits = self.logits[idx]


@dataclass
class _BucketResult:
    """Decoded tokens of a bucket: [R, max_tokens] buffers plus per-row length."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    lengths: torch.Tensor
    stopped: torch.Tensor
    versions: torch.Tensor  # [R, max_tokens] policy version that sampled each token


class TorchEngine(EngineBase):
    """A Hugging Face causal LM sampling in buckets with a KV cache; thread-safe."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        device: str = "auto",
        dtype: str = "float32",
        max_batch_size: int = 256,
        eos_token_ids: Sequence[int] | None = None,
        version: int = 0,
        partial_rollouts: bool = False,
    ) -> None:
        self.device = resolve_device(device)
        self.max_batch_size = max_batch_size
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=_DTYPES[dtype]
        )
        torch.nn.Module.to(self.model, self.device)  # (transformers' typed `to` hides Module's)
        self.model.eval()
        embeddings = self.model.get_input_embeddings()
        assert isinstance(embeddings, torch.nn.Embedding)
        super().__init__(embeddings.num_embeddings, version, partial_rollouts)
        generation_eos = self.model.generation_config.eos_token_id
        self.eos_token_ids = (
            list(eos_token_ids)
            if eos_token_ids is not None
            else default_eos(generation_eos, self.tokenizer)
        )
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = pad if pad is not None else (self.eos_token_ids or [0])[0]
        self._model_lock = threading.Lock()  # one bucket at a time on the model
        self._model_cpu_s = 0.0  # CPU time of the generating threads, under the lock

    @classmethod
    def from_config(
        cls, model_path: str | Path, config: TorchEngineConfig, partial_rollouts: bool = False
    ) -> TorchEngine:
        """Build from the rollout server's engine config."""
        return cls(
            model_path,
            device=config.device,
            dtype=config.dtype,
            max_batch_size=config.max_batch_size,
            partial_rollouts=partial_rollouts,
        )

    def model_cpu_seconds(self) -> float:
        """The generating thread's CPU time (with torch's intra-op threads at 1, as the
        CPU presets set them, that is all of the model's; with more, their share is not
        in it)."""
        return self._model_cpu_s

    # -- generation -------------------------------------------------------------------

    def _samples(
        self, prompts: list[list[int]], params: SamplingParams, seed: int
    ) -> Iterator[StreamedSample]:
        """Run buckets one at a time; nothing is held while the caller consumes."""
        buckets = plan_batches([len(p) for p in prompts], params.n, self.max_batch_size)
        for bucket in buckets:
            self._gate.enter()
            try:
                with self._model_lock:
                    cpu = time.thread_time()
                    done = self._run_bucket(bucket, prompts, params, seed)
                    self._model_cpu_s += time.thread_time() - cpu
            finally:
                self._gate.leave()
            yield from done

    @torch.inference_mode()
    def _run_bucket(
        self,
        bucket: list[tuple[int, int]],
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        seed: int,
    ) -> list[StreamedSample]:
        """Prefill and decode one bucket; the caller holds the model lock."""
        state = self._prefill(bucket, prompts, params, seed)
        contexts = [list(prompts[i]) for i, _ in bucket]
        result = self._decode(state, params, contexts)
        return self._outputs(bucket, result)

    def _prefill(
        self,
        bucket: list[tuple[int, int]],
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        seed: int,
    ) -> _DecodeState:
        """Run each distinct prompt once, then copy its cache to its sample rows."""
        distinct = list(dict.fromkeys(i for i, _ in bucket))
        slot = {i: k for k, i in enumerate(distinct)}
        logits, cache, mask, positions = self._forward_contexts([prompts[i] for i in distinct])
        expand = torch.tensor([slot[i] for i, _ in bucket], device=self.device)
        cache.batch_select_indices(expand)
        uniforms = {i: draw_uniforms(seed, i, params.n, params.max_tokens) for i in distinct}
        return _DecodeState(
            rows=torch.arange(len(bucket), device=self.device),
            live=torch.ones(len(bucket), dtype=torch.bool, device=self.device),
            cache=cache,
            mask=mask[expand],
            next_pos=positions[expand, -1] + 1,
            uniforms=torch.stack([uniforms[i][j] for i, j in bucket]).to(self.device),
            logits=logits[expand],
        )

    def _forward_contexts(
        self, contexts: Sequence[Sequence[int]]
    ) -> tuple[torch.Tensor, DynamicCache, torch.Tensor, torch.Tensor]:
        """Prefill left-padded contexts: next-token logits [B, V], cache, mask, positions."""
        ids, mask = _left_pad(contexts, self.pad_token_id, self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1], cache, mask, positions

    def _decode(
        self, state: _DecodeState, params: SamplingParams, contexts: list[list[int]]
    ) -> _BucketResult:
        """Sample until every row hit a stop token or max_tokens (`contexts`: row prompts)."""
        shape = (len(contexts), params.max_tokens)
        res = _BucketResult(
            tokens=torch.zeros(shape, dtype=torch.long, device=self.device),
            logprobs=torch.zeros(shape, dtype=torch.float32, device=self.device),
            lengths=torch.zeros(len(contexts), dtype=torch.long, device=self.device),
            stopped=torch.zeros(len(contexts), dtype=torch.bool, device=self.device),
            versions=torch.zeros(shape, dtype=torch.long, device=self.device),
        )
        stops = torch.tensor(stop_ids(params, self.eos_token_ids), device=self.device).long()
        for step in range(params.max_tokens):
            tokens, logprobs = sample_next(state.logits, params, state.uniforms[:, step])
            live, rows = state.live, state.rows[state.live]
            res.tokens[rows, step] = tokens[live]
            res.logprobs[rows, step] = logprobs[live]
            res.versions[rows, step] = self._version
            res.lengths[rows] = step + 1
            hit = torch.isin(tokens, stops) & live
            res.stopped[rows] = hit[live]
            state.live = live & ~hit
            if step + 1 == params.max_tokens or not bool(state.live.any()):
                break
            if self._preempt_wanted():
                state = self._refill_after_swap(state, contexts, res, step + 1)
                continue
            self._step(state, tokens)
            state.compact_if_sparse()
        return res

    def _refill_after_swap(
        self, state: _DecodeState, contexts: list[list[int]], res: _BucketResult, done: int
    ) -> _DecodeState:
        """Let the waiting swap in, then rebuild the live rows' KV cache from prompt + the
        `done` tokens so far under the new weights (the old cache is the old policy's)."""
        self._model_lock.release()
        try:
            self._yield_to_swap()
        finally:
            self._model_lock.acquire()
        rows = state.rows[state.live]
        sofar = res.tokens[rows, :done].tolist()
        full = [contexts[r] + toks for r, toks in zip(rows.tolist(), sofar, strict=True)]
        logits, cache, mask, positions = self._forward_contexts(full)
        return _DecodeState(
            rows=rows,
            live=torch.ones(len(full), dtype=torch.bool, device=self.device),
            cache=cache,
            mask=mask,
            next_pos=positions[:, -1] + 1,
            uniforms=state.uniforms[state.live],
            logits=logits,
        )

    def _step(self, state: _DecodeState, tokens: torch.Tensor) -> None:
        """Feed the sampled tokens; leaves the next logits in `state`."""
        ones = torch.ones_like(state.mask[:, :1])
        state.mask = torch.cat([state.mask, ones], dim=-1)
        out = self.model(
            input_ids=tokens[:, None],
            attention_mask=state.mask,
            position_ids=state.next_pos[:, None],
            past_key_values=state.cache,
            use_cache=True,
        )
        state.logits = out.logits[:, -1]
        state.next_pos = state.next_pos + 1

    def _outputs(self, bucket: list[tuple[int, int]], res: _BucketResult) -> list[StreamedSample]:
        """Turn the bucket's buffers into per-sample outputs (one device sync). A row
        sampled by one version carries no per-token versions (SampleOutput: empty), as
        every row does without partial rollouts."""
        tokens, logprobs = res.tokens.cpu().numpy(), res.logprobs.cpu().numpy()
        versions, lengths = res.versions.cpu().numpy(), res.lengths.cpu().numpy()
        # Each row's oldest and newest version over its own tokens, for the bucket at once.
        own = np.arange(versions.shape[1]) < lengths[:, None]
        oldest = np.where(own, versions, self._version).min(axis=1, initial=self._version)
        mixed = (np.where(own, versions, oldest[:, None]) != oldest[:, None]).any(axis=1)
        oldest, lengths, stopped = oldest.tolist(), lengths.tolist(), res.stopped.tolist()
        return [
            StreamedSample(
                request_index=i,
                sample_index=j,
                output=SampleOutput(
                    token_ids=tokens[r, : lengths[r]].copy(),
                    logprobs=logprobs[r, : lengths[r]].copy(),
                    finish_reason="stop" if stopped[r] else "length",
                    policy_version=oldest[r],
                    token_versions=(
                        versions[r, : lengths[r]].copy() if mixed[r] else np.empty(0, np.int64)
                    ),
                ),
            )
            for r, (i, j) in enumerate(bucket)
        ]

    # -- weights and flow control -----------------------------------------------------

    def load_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, owned: bool = False
    ) -> None:
        """Check every tensor first, then swap all in between two buckets: an owned tensor
        is served in place (its parameter adopts the memory, no copy), others copied."""
        updates = list(named_tensors)
        targets = self.model.state_dict(keep_vars=True)
        check_weights(updates, {name: (t.shape, t.dtype) for name, t in targets.items()})
        refuse_missing(uncovered({name for name, _ in updates}, targets), "torch")
        with self._swap(version), torch.no_grad():
            for name, tensor in updates:
                target, moved = targets[name], tensor.to(self.device)
                if owned and moved.is_contiguous() and target.is_contiguous():
                    target.data = moved  # a tied weight: one Parameter under both names
                else:
                    target.copy_(moved)

    def pause(self) -> None:
        """Hold new buckets until `resume()`; returns once the bucket in flight is done."""
        super().pause()
        self._gate.wait_idle()
