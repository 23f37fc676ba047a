"""Partial rollouts: a weight update lands between two tokens of a response, and every
token's recorded version and behaviour log-prob survive the trip to the learner's batch
exactly (what the learner recomputes under that version's weights)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from engine_contract import perturbed
from transformers import AutoModelForCausalLM

from dapo.v1 import records_pb2, rollout_pb2
from learner.algorithm import token_logprobs
from learner.batch import collate, sequences_from_groups
from rollout.adapter import completion
from rollout.config import RolloutSettings
from rollout.engine import SampleOutput, SamplingParams
from rollout.torch_engine import TorchEngine
from services.common.adapters import (
    completion_to_proto,
    group_from_proto,
    group_to_proto,
    sample_from_completion,
)
from services.common.types import Group, Sample

PROMPTS = [[3, 5, 7, 9], [4, 6]]
PARAMS = SamplingParams(n=3, temperature=1.0, max_tokens=12, ignore_eos=True, seed=11)
SWAP_AFTER = 5  # decode steps before the swap is let in


class SwapMidResponse(TorchEngine):
    """The real engine, held after its SWAP_AFTER-th decode step until a swap waits, so
    the update lands mid-response however the threads are scheduled."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.steps = 0
        self.reached = threading.Event()

    def _step(self, state, tokens) -> None:
        super()._step(state, tokens)
        self.steps += 1
        if self.steps == SWAP_AFTER:
            self.reached.set()
            deadline = time.monotonic() + 10
            while not self._gate.swap_waiting() and time.monotonic() < deadline:
                time.sleep(0.001)


def generate_across_swap(model_dir: Path, partial: bool) -> tuple[list[list[SampleOutput]], list]:
    """Generate while version 1 (perturbed weights) is loaded mid-way; (outputs, v1)."""
    engine = SwapMidResponse(model_dir, device="cpu", max_batch_size=4, partial_rollouts=partial)
    new = perturbed(engine.model, torch.float32, 0.05)  # logits of a sane size
    result: list[list[SampleOutput]] = []
    worker = threading.Thread(target=lambda: result.extend(engine.generate(PROMPTS, PARAMS)))
    worker.start()
    assert engine.reached.wait(30)
    engine.load_weights(new, version=1)
    worker.join(60)
    assert not worker.is_alive() and engine.version == 1
    return result, new


def through_the_wire(outputs: list[list[SampleOutput]]) -> list[Group]:
    """Rollout Completion → controller Sample → `scored`/`train` stream record → Group."""
    groups = []
    for i, samples in enumerate(outputs):
        wire = [
            rollout_pb2.Completion.FromString(completion(o, "").SerializeToString())
            for o in samples
        ]
        group = Group(
            f"g{i}", f"p{i}", "", PROMPTS[i], "", [sample_from_completion(c) for c in wire]
        )
        for k, s in enumerate(group.samples):
            s.reward = float(k % 2)
        record = group_to_proto(group).SerializeToString()
        groups.append(group_from_proto(records_pb2.ScoredGroup.FromString(record)))
    return groups


def learner_logprobs(model_dir: Path, weights: list | None, groups: list[Group]) -> torch.Tensor:
    """The learner's log-probs `[B, L − 1]` of its own batch, under the given weights."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if weights is not None:
        model.load_state_dict(dict(weights))
    inputs = collate(sequences_from_groups(groups), pad_token_id=0)
    with torch.no_grad():
        logits = model(input_ids=inputs.input_ids, attention_mask=inputs.attention_mask).logits
    logprobs, _ = token_logprobs(logits[:, :-1], inputs.input_ids[:, 1:], PARAMS.temperature)
    return logprobs


def test_every_token_matches_the_learner_under_its_own_version(tiny_model: Path) -> None:
    """To 1e-5 relative to max(1, |log-prob|) (fp32: the cached, left-padded decode and the
    learner's full right-padded forward sum in different orders); under the other version
    the same tokens are far off, so the recorded versions are what makes them match."""
    outputs, v1 = generate_across_swap(tiny_model, partial=True)
    groups = through_the_wire(outputs)
    seqs = sequences_from_groups(groups)
    assert any(s.token_versions is not None and len(set(s.token_versions)) == 2 for s in seqs)
    assert [g.min_policy_version for g in groups] == [0, 0]
    learner = {
        0: learner_logprobs(tiny_model, None, groups),
        1: learner_logprobs(tiny_model, v1, groups),
    }
    gaps: dict[int, list[float]] = {0: [], 1: []}
    other: list[float] = []
    for row, seq in enumerate(seqs):
        assert seq.token_versions is not None and seq.rollout_logprobs is not None
        at = len(seq.prompt_ids) - 1  # logits at t - 1 score token t
        for t, (v, behaviour) in enumerate(
            zip(seq.token_versions, seq.rollout_logprobs, strict=True)
        ):
            gaps[v].append(
                abs(float(learner[v][row, at + t]) - behaviour) / max(1.0, abs(behaviour))
            )
            other.append(abs(float(learner[1 - v][row, at + t]) - behaviour))
    assert gaps[0] and gaps[1], "no token from one of the versions"
    assert max(gaps[0] + gaps[1]) <= 1e-5
    assert sum(other) / len(other) > 1e-2


def test_a_swap_waits_for_the_batch_without_partial_rollouts(tiny_model: Path) -> None:
    outputs, _ = generate_across_swap(tiny_model, partial=False)
    flat = [o for prompt in outputs for o in prompt]
    assert all(len(o.token_versions) == 0 for o in flat)  # one version each: no list
    assert {o.policy_version for o in flat} == {0, 1}  # first bucket before, second after


def test_uniform_versions_stay_off_the_wire() -> None:
    out = SampleOutput([1, 2], [-0.1, -0.2], "stop", 3, token_versions=[3, 3])
    assert completion(out, "").token_versions_i64 == b""
    mixed = completion(SampleOutput([1, 2], [-0.1, -0.2], "stop", 3, [3, 4]), "")
    assert mixed.policy_version == 3 and len(mixed.token_versions_i64) == 16
    assert sample_from_completion(mixed).versions().tolist() == [3, 4]


def test_mismatched_versions_are_refused() -> None:
    sample = Sample([1, 2], [0.0, 0.0], "", "stop", 1, token_versions=[1])
    bad = completion_to_proto(sample)
    with pytest.raises(ValueError, match="1 token versions for 2 tokens"):
        sample_from_completion(bad)
    bad.token_ids_i32 += b"\x00"  # not a whole number of int32s
    with pytest.raises(ValueError, match="not a multiple of 4"):
        sample_from_completion(bad)
    bad.token_ids_i32 = bad.token_ids_i32[:-1]
    bad.token_versions_i64 = b""
    assert sample_from_completion(bad).token_ids.tolist() == [1, 2]
    bad = rollout_pb2.Completion(
        token_ids_i32=bytes(8),
        logprobs_f32=bytes(8),
        token_versions_i64=bytes(8),
        finish_reason=rollout_pb2.FINISH_REASON_STOP,
    )
    with pytest.raises(ValueError, match="1 token versions for 2 tokens"):
        sample_from_completion(bad)


@pytest.mark.parametrize(
    ("staleness", "explicit", "on"),
    [(0, None, False), (1, None, True), (1, False, False), (0, True, True)],
)
def test_switch_defaults_to_on_for_async_runs(
    staleness: int, explicit: bool | None, on: bool
) -> None:
    settings = RolloutSettings.model_validate(
        {"shared": {"max_staleness": staleness}, "rollout": {"partial_rollouts": explicit}}
    )
    assert settings.partial_rollouts() is on
