"""Contract tests every `RolloutEngine` must pass (torch engine now, vLLM engine later).

Use: subclass `EngineContract` in a `test_*.py` file as `TestXxx(EngineContract)` and give
it a `harness` fixture returning an `EngineHarness`. The engine may be shared by all tests
(vLLM starts slowly): tests that change its weights put the original ones back.

The reference for log-probs is a plain Hugging Face forward in fp32 over prompt +
response, i.e. what the learner recomputes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollout.engine import RolloutEngine, SampleOutput, SamplingParams

# Mixed lengths on purpose: a bucket holds them left-padded.
PROMPTS: list[list[int]] = [[3, 7, 1, 12], [5], [1, 2, 3, 4, 5, 6, 7, 8, 9], [9, 9, 12]]


@dataclass
class EngineHarness:
    """An engine plus what the contract needs to check it."""

    engine: RolloutEngine
    model_dir: Path  # the HF directory the engine's initial weights came from
    weight_dtype: torch.dtype = torch.float32  # dtype `load_weights` expects
    logprob_atol: float = 1e-4


def teacher_forced_logprobs(
    model: torch.nn.Module, prompt: Sequence[int], response: Sequence[int], temperature: float
) -> torch.Tensor:
    """log_softmax(logits / T) of each response token from one unpadded forward."""
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    logprobs = (logits / temperature).log_softmax(-1)[len(prompt) - 1 : -1]
    return logprobs.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def greedy_reference(model: torch.nn.Module, prompt: Sequence[int], steps: int) -> list[int]:
    """Argmax decoding by full forwards (no cache), the slowest obviously-right way."""
    ids = list(prompt)
    for _ in range(steps):
        with torch.no_grad():
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def tokens_of(outputs: list[list[SampleOutput]]) -> list[list[list[int]]]:
    """Just the token ids, for comparing whole generations."""
    return [[s.token_ids.tolist() for s in samples] for samples in outputs]


def perturbed(
    model: torch.nn.Module, dtype: torch.dtype, scale: float
) -> list[tuple[str, torch.Tensor]]:
    """Every weight plus deterministic noise: a different policy of the same shape."""
    gen = torch.Generator().manual_seed(1234)
    return [
        (name, (t + scale * torch.randn(t.shape, generator=gen)).to(dtype))
        for name, t in model.state_dict().items()
    ]


GREEDY = SamplingParams(n=1, temperature=0.0, max_tokens=6, ignore_eos=True)


class EngineContract:
    """The behaviour the rollout service relies on, for any engine."""

    @pytest.fixture(scope="class")
    @classmethod
    def reference(cls, harness: EngineHarness) -> torch.nn.Module:
        model = AutoModelForCausalLM.from_pretrained(harness.model_dir, dtype=torch.float32)
        return model.eval()

    def restore(self, harness: EngineHarness, reference: torch.nn.Module) -> None:
        """Put the original weights back, moving the version forward."""
        weights = [(k, v.to(harness.weight_dtype)) for k, v in reference.state_dict().items()]
        harness.engine.load_weights(weights, harness.engine.version + 1)

    def test_shapes_lengths_and_version(self, harness: EngineHarness) -> None:
        params = SamplingParams(n=3, max_tokens=5, ignore_eos=True, seed=0)
        out = harness.engine.generate(PROMPTS, params)
        assert len(out) == len(PROMPTS)
        for samples in out:
            assert len(samples) == 3
            for s in samples:
                assert len(s.token_ids) == len(s.logprobs) == 5
                assert s.finish_reason == "length"
                assert s.policy_version == harness.engine.version
                assert all(lp <= 0.0 and lp > -1e4 for lp in s.logprobs)

    def test_stream_yields_each_sample_once(self, harness: EngineHarness) -> None:
        params = SamplingParams(n=2, max_tokens=3, seed=1)
        seen = [(x.request_index, x.sample_index) for x in harness.engine.stream(PROMPTS, params)]
        assert sorted(seen) == [(i, j) for i in range(len(PROMPTS)) for j in range(2)]

    def test_stop_token_ends_sample_with_stop(self, harness: EngineHarness) -> None:
        free = harness.engine.generate(PROMPTS, GREEDY)
        for prompt, [sample] in zip(PROMPTS, free, strict=True):
            stop = int(sample.token_ids[2])
            cut = sample.token_ids.tolist().index(stop) + 1
            params = SamplingParams(
                n=1, temperature=0.0, max_tokens=6, stop_token_ids=(stop,), ignore_eos=True
            )
            [[stopped]] = harness.engine.generate([prompt], params)
            assert stopped.finish_reason == "stop"
            assert stopped.token_ids.tolist() == sample.token_ids[:cut].tolist()  # stop kept
            assert len(stopped.logprobs) == cut

    def test_logprobs_match_teacher_forcing(
        self, harness: EngineHarness, reference: torch.nn.Module
    ) -> None:
        for temperature, top_p, top_k in [(1.0, 1.0, -1), (0.7, 0.9, 5)]:
            params = SamplingParams(
                n=2, temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=6, seed=3
            )
            out = harness.engine.generate(PROMPTS, params)
            for prompt, samples in zip(PROMPTS, out, strict=True):
                for s in samples:
                    want = teacher_forced_logprobs(reference, prompt, s.token_ids, temperature)
                    got = torch.tensor(s.logprobs)
                    torch.testing.assert_close(got, want, atol=harness.logprob_atol, rtol=0)

    def test_same_seed_same_samples(self, harness: EngineHarness) -> None:
        params = SamplingParams(n=4, max_tokens=6, ignore_eos=True, seed=7)
        first = harness.engine.generate(PROMPTS, params)
        again = harness.engine.generate(PROMPTS, params)
        other = harness.engine.generate(PROMPTS, SamplingParams(**{**params.__dict__, "seed": 8}))
        assert tokens_of(first) == tokens_of(again)
        assert tokens_of(first) != tokens_of(other)
        # n samples of one prompt differ from each other too
        assert len({tuple(s.token_ids) for s in first[2]}) > 1

    def test_low_temperature_is_greedy(
        self, harness: EngineHarness, reference: torch.nn.Module
    ) -> None:
        cold = SamplingParams(n=2, temperature=1e-4, max_tokens=6, ignore_eos=True, seed=5)
        out = harness.engine.generate(PROMPTS, cold)
        greedy = harness.engine.generate(PROMPTS, GREEDY)
        for prompt, samples, [g] in zip(PROMPTS, out, greedy, strict=True):
            want = greedy_reference(reference, prompt, 6)
            assert g.token_ids.tolist() == want
            assert all(s.token_ids.tolist() == want for s in samples)

    def test_load_weights_changes_generation_and_version(
        self, harness: EngineHarness, reference: torch.nn.Module
    ) -> None:
        engine = harness.engine
        before, version = tokens_of(engine.generate(PROMPTS, GREEDY)), engine.version
        try:
            engine.load_weights(perturbed(reference, harness.weight_dtype, 0.5), version + 1)
            assert engine.version == version + 1
            after = engine.generate(PROMPTS, GREEDY)
            assert tokens_of(after) != before
            assert all(s.policy_version == version + 1 for ss in after for s in ss)
        finally:
            self.restore(harness, reference)
        assert tokens_of(engine.generate(PROMPTS, GREEDY)) == before

    @pytest.mark.parametrize("defect", ["unknown name", "wrong shape", "wrong dtype"])
    def test_bad_weights_are_rejected_and_old_ones_kept(
        self, harness: EngineHarness, reference: torch.nn.Module, defect: str
    ) -> None:
        engine = harness.engine
        before, version = tokens_of(engine.generate(PROMPTS, GREEDY)), engine.version
        good = perturbed(reference, harness.weight_dtype, 0.5)  # valid and different
        name, tensor = good[-1]
        bad = {
            "unknown name": ("model.no_such_layer.weight", tensor),
            "wrong shape": (name, tensor[..., :1].contiguous()),
            "wrong dtype": (name, tensor.to(torch.float64)),
        }[defect]
        with pytest.raises(ValueError, match=bad[0].replace(".", r"\.")):
            engine.load_weights([*good, bad], version + 1)
        assert engine.version == version
        assert tokens_of(engine.generate(PROMPTS, GREEDY)) == before

    @pytest.mark.parametrize("keep", [0, 1])
    def test_incomplete_weight_sets_are_rejected(
        self, harness: EngineHarness, reference: torch.nn.Module, keep: int
    ) -> None:
        """Samples tagged with a version must come from all of that version's weights."""
        engine = harness.engine
        before, version = tokens_of(engine.generate(PROMPTS, GREEDY)), engine.version
        good = perturbed(reference, harness.weight_dtype, 0.5)
        with pytest.raises(ValueError, match="missing"):
            engine.load_weights(good[:keep], version + 1)
        assert engine.version == version
        assert tokens_of(engine.generate(PROMPTS, GREEDY)) == before

    def test_pause_holds_new_work_until_resume(self, harness: EngineHarness) -> None:
        engine, results = harness.engine, []
        engine.pause()
        try:
            worker = threading.Thread(
                target=lambda: results.append(engine.generate(PROMPTS, GREEDY))
            )
            worker.start()
            time.sleep(0.3)
            assert not results
        finally:
            engine.resume()
        worker.join(timeout=30)
        assert len(results) == 1 and len(results[0]) == len(PROMPTS)
