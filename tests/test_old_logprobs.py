"""`learner.objective.old_logprobs: auto`: the engine's log-probs as π_old only when the
recompute cannot change anything, and then the step equals the recompute path.

Tiny random Qwen2 models (fp32, temperature ≠ 1, two updates per step so the second
update's ratio and clipping see π_old), on the torch engine in this process.
"""

from __future__ import annotations

import copy

import torch
from learner_fixtures import make_groups
from test_learner_logprobs import TEMPERATURE, _cfg, tiny_qwen

from learner.batch import sequences_from_groups
from learner.config import LearnerConfig
from learner.old_logprobs import RECHECK_EVERY, OldLogprobGate, same_version_gap
from learner.step import recompute_old_logprobs, train_step
from learner.torch_policy import TorchPolicy
from services.common.types import Group, logprob_array

MAX_LEN = 16


def _config(**objective: object) -> LearnerConfig:
    return _cfg(3, batching={"mini_batch_responses": 8}, objective=objective)


def _engine_groups(model: torch.nn.Module, cfg: LearnerConfig, shift: float = 0.0) -> list[Group]:
    """Groups whose engine log-probs are the learner's own (+ `shift`), all of version 0."""
    groups = make_groups(seed=5)
    seqs = sequences_from_groups(groups)
    recompute_old_logprobs(TorchPolicy(copy.deepcopy(model), cfg), seqs, cfg, 0, TEMPERATURE)
    samples = [s for g in groups for s in g.samples]
    for sample, seq in zip(samples, seqs, strict=True):
        assert seq.old_logprobs is not None
        sample.logprobs = logprob_array((seq.old_logprobs + shift).tolist())
    return groups


def _step(model, cfg, groups, gate):  # type: ignore[no-untyped-def]
    policy = TorchPolicy(copy.deepcopy(model), cfg)
    metrics = train_step(
        policy, groups, cfg, 0, TEMPERATURE, MAX_LEN, seed=3, version=0, old_logprobs=gate
    )
    return metrics, dict(policy.model.named_parameters())


def test_reusing_the_engine_logprobs_gives_the_recompute_step() -> None:
    """Engine log-probs equal to the learner's: the step without the recompute updates
    every parameter as the step with it, and reports the same loss and clipping."""
    model, cfg = tiny_qwen(False), _config()
    groups = _engine_groups(model, cfg)
    gate = OldLogprobGate.from_config(cfg.objective)
    gate.record(0.0)  # as if a recompute had measured no gap
    reused, got = _step(model, cfg, groups, gate)
    recomputed, want = _step(model, cfg, groups, None)
    assert (reused.old_logprobs_reused, recomputed.old_logprobs_reused) == (1, 0)
    assert reused.updates == recomputed.updates == 2
    assert abs(reused.loss - recomputed.loss) < 1e-6
    assert reused.clip_frac_high == recomputed.clip_frac_high
    assert reused.clip_frac_low == recomputed.clip_frac_low
    start = dict(model.named_parameters())
    for name, param in want.items():
        assert not torch.equal(param, start[name]), name  # the step moved it
        torch.testing.assert_close(got[name], param, atol=1e-6, rtol=0, msg=name)


def test_auto_measures_first_then_reuses_until_the_recheck() -> None:
    model, cfg = tiny_qwen(False), _config()
    groups = _engine_groups(model, cfg)
    gate = OldLogprobGate.from_config(cfg.objective)
    first, _ = _step(model, cfg, groups, gate)
    assert first.old_logprobs_reused == 0  # nothing measured yet
    assert gate.gap is not None and gate.gap <= cfg.objective.old_logprobs_max_gap
    for _ in range(RECHECK_EVERY):
        assert _step(model, cfg, groups, gate)[0].old_logprobs_reused == 1
    assert _step(model, cfg, groups, gate)[0].old_logprobs_reused == 0  # re-measured
    assert gate.steps_since == 0


def test_auto_recomputes_when_the_engine_disagrees() -> None:
    """A gap of 0.01 per token (above the 1e-4 bound) is measured and keeps the recompute."""
    model, cfg = tiny_qwen(False), _config()
    groups = _engine_groups(model, cfg, shift=0.01)
    gate = OldLogprobGate.from_config(cfg.objective)
    for _ in range(2):
        assert _step(model, cfg, groups, gate)[0].old_logprobs_reused == 0
    assert gate.gap is not None and abs(gate.gap - 0.01) < 1e-5


def test_auto_recomputes_for_stale_tokens_references_and_when_off() -> None:
    model, cfg = tiny_qwen(False), _config()
    seqs = sequences_from_groups(_engine_groups(model, cfg))
    gate = OldLogprobGate.from_config(cfg.objective)
    gate.record(0.0)
    assert gate.reuse(seqs, 0, has_reference=False)
    assert not gate.reuse(seqs, 1, has_reference=False)  # sampled by an older version
    assert not gate.reuse(seqs, 0, has_reference=True)  # π_ref needs a forward anyway
    seqs[3].token_versions = torch.tensor([0] * (len(seqs[3].response_ids) - 1) + [1]).numpy()
    assert not gate.reuse(seqs, 0, has_reference=False)  # one token from another version
    seqs[3].token_versions = None
    seqs[4].rollout_logprobs = None
    assert not gate.reuse(seqs, 0, has_reference=False)  # no engine log-probs to use
    fresh = sequences_from_groups(_engine_groups(model, cfg))
    for objective in ({"old_logprobs": "recompute"}, {"clip_ratio_low": 0.0}):
        off = OldLogprobGate.from_config(_config(**objective).objective)
        off.record(0.0)
        assert not off.reuse(fresh, 0, False), objective  # off, or a bound too near the clip


def test_the_gap_is_measured_on_same_version_tokens_only() -> None:
    model, cfg = tiny_qwen(False), _config()
    seqs = sequences_from_groups(_engine_groups(model, cfg, shift=0.5))
    recompute_old_logprobs(TorchPolicy(copy.deepcopy(model), cfg), seqs, cfg, 0, TEMPERATURE)
    gap = same_version_gap(seqs, 0)
    assert gap is not None and abs(gap - 0.5) < 1e-5
    assert same_version_gap(seqs, 7) is None  # no token sampled by version 7
