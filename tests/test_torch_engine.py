"""Torch engine: the shared engine contract plus what is specific to its implementation."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from engine_contract import (
    GREEDY,
    PROMPTS,
    EngineContract,
    EngineHarness,
    perturbed,
    tokens_of,
)

from rollout.config import TorchEngineConfig
from rollout.engine import RolloutEngine, SamplingParams
from rollout.torch_engine import TorchEngine, plan_batches, sample_next


@pytest.fixture(scope="module")
def model_dir(tiny_model: Path) -> Path:
    """The session's tiny model (conftest); engines here never write to it."""
    return tiny_model


class TestTorchEngineContract(EngineContract):
    @pytest.fixture(scope="class")
    @classmethod
    def harness(cls, model_dir: Path) -> EngineHarness:
        # A small batch size splits a prompt's n rows over buckets: exercised on purpose.
        engine = TorchEngine(model_dir, device="cpu", max_batch_size=5)
        return EngineHarness(engine=engine, model_dir=model_dir)


def test_implements_protocol_and_reads_config(model_dir: Path) -> None:
    config = TorchEngineConfig(device="cpu", dtype="float32", max_batch_size=7)
    engine = TorchEngine.from_config(model_dir, config)
    assert isinstance(engine, RolloutEngine)
    assert engine.max_batch_size == 7 and engine.version == 0
    assert engine.eos_token_ids == [engine.tokenizer.eos_token_id]


def test_plan_batches_sorts_by_length_and_bounds_size() -> None:
    buckets = plan_batches([3, 1, 2], n=2, max_batch_size=4)
    assert buckets == [[(1, 0), (1, 1), (2, 0), (2, 1)], [(0, 0), (0, 1)]]


def test_samples_do_not_depend_on_batch_composition(model_dir: Path) -> None:
    params = SamplingParams(n=3, max_tokens=6, seed=11)
    one = TorchEngine(model_dir, device="cpu", max_batch_size=1).generate(PROMPTS, params)
    many = TorchEngine(model_dir, device="cpu", max_batch_size=64).generate(PROMPTS, params)
    assert tokens_of(one) == tokens_of(many)
    for a, b in zip(one, many, strict=True):
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs))


def test_eos_stops_a_sample(model_dir: Path) -> None:
    prompt = PROMPTS[0]
    first = TorchEngine(model_dir, device="cpu").generate([prompt], GREEDY)[0][0].token_ids[0]
    engine = TorchEngine(model_dir, device="cpu", eos_token_ids=[first])
    [[sample]] = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6))
    assert (sample.token_ids, sample.finish_reason) == ([first], "stop")
    [[ignored]] = engine.generate([prompt], GREEDY)
    assert (len(ignored.token_ids), ignored.finish_reason) == (6, "length")


def test_bad_prompts_are_rejected_on_call(model_dir: Path) -> None:
    engine = TorchEngine(model_dir, device="cpu")
    with pytest.raises(ValueError, match="at least one token"):
        engine.stream([[1], []], SamplingParams())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.stream([[1, len(engine.tokenizer)]], SamplingParams())


@pytest.mark.parametrize(
    "kwargs", [{"n": 0}, {"temperature": -1.0}, {"top_p": 0.0}, {"top_k": 0}, {"max_tokens": 0}]
)
def test_sampling_params_are_validated(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def _frequencies(logits: torch.Tensor, params: SamplingParams, draws: int) -> torch.Tensor:
    uniforms = torch.rand(draws, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    tokens, _ = sample_next(logits.expand(draws, -1), params, uniforms)
    return torch.bincount(tokens, minlength=logits.shape[-1]).float() / draws


def test_sampling_follows_the_tempered_and_truncated_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    probs = (logits[0] / 0.8).softmax(-1)
    full = _frequencies(logits, SamplingParams(temperature=0.8), 40_000)
    torch.testing.assert_close(full, probs, atol=0.01, rtol=0)
    top2 = _frequencies(logits, SamplingParams(temperature=0.8, top_k=2), 40_000)
    torch.testing.assert_close(top2[:2], probs[:2] / probs[:2].sum(), atol=0.01, rtol=0)
    assert top2[2:].sum() == 0
    nucleus = _frequencies(logits, SamplingParams(temperature=0.8, top_p=float(probs[0])), 1000)
    assert nucleus[0] == 1.0  # mass before token 1 reaches top_p: only token 0 remains


def test_owned_weights_are_served_in_place_and_others_copied(model_dir: Path) -> None:
    engine = TorchEngine(model_dir, device="cpu")
    params = engine.model.state_dict(keep_vars=True)
    before = {n: p.data_ptr() for n, p in params.items()}
    tied: dict[int, torch.Tensor] = {}  # tied names (embedding and head) get one tensor
    other = {
        n: tied.setdefault(before[n], t) for n, t in perturbed(engine.model, torch.float32, 0.5)
    }
    engine.load_weights(list(other.items()), 1)  # not owned: copied, the caller keeps its own
    assert {n: p.data_ptr() for n, p in params.items()} == before
    assert all(torch.equal(params[n], t) for n, t in other.items())
    fresh = {n: 2 * t for n, t in other.items()}  # new memory, nobody else's
    fresh = {n: tied.setdefault(-before[n], t) for n, t in fresh.items()}
    engine.load_weights(list(fresh.items()), 2, owned=True)
    assert all(params[n].data_ptr() == t.data_ptr() for n, t in fresh.items())
    assert tokens_of(engine.generate(PROMPTS, GREEDY)) != tokens_of(
        TorchEngine(model_dir, device="cpu").generate(PROMPTS, GREEDY)
    )


def test_weight_swaps_never_happen_mid_batch(model_dir: Path) -> None:
    """Every sample is exactly what its tagged version generates greedily."""
    engine = TorchEngine(model_dir, device="cpu", max_batch_size=2)
    base = [(k, v.detach().clone()) for k, v in engine.model.state_dict().items()]
    other = perturbed(engine.model, torch.float32, 0.5)
    expected = {0: tokens_of(engine.generate(PROMPTS, GREEDY))}
    engine.load_weights(other, 1)
    expected[1] = tokens_of(engine.generate(PROMPTS, GREEDY))
    assert expected[0] != expected[1]
    seen: list[tuple[int, int, list[int]]] = []

    def generate_until_both_versions_seen() -> None:
        """At least 15 rounds, and on until samples of both versions came out (a fixed
        number of rounds could finish before the first swap on a loaded machine)."""
        for rounds in range(1, 1000):
            for x in engine.stream(PROMPTS, GREEDY):
                seen.append((x.output.policy_version, x.request_index, x.output.token_ids))
            if rounds >= 15 and len({v % 2 for v, _, _ in seen}) == 2:
                return

    worker = threading.Thread(target=generate_until_both_versions_seen)
    worker.start()
    version = 2
    while worker.is_alive():  # swap for as long as generation runs
        engine.load_weights(base if version % 2 == 0 else other, version)
        version += 1
    worker.join()
    assert len(seen) >= 15 * len(PROMPTS) and len(seen) % len(PROMPTS) == 0
    assert len({v % 2 for v, _, _ in seen}) == 2, "weights never changed during generation"
    assert all(list(tokens) == expected[v % 2][i][0] for v, i, tokens in seen)
