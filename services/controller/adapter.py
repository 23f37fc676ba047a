"""The controller's one translation to and from the rollout and reward protobufs."""

from __future__ import annotations

from dapo.v1 import reward_pb2, rollout_pb2
from services.common.adapters import sample_from_completion
from services.common.data import PromptRecord
from services.common.settings import SamplingConfig
from services.common.types import Sample

VERIFIERS = {
    "default": reward_pb2.VERIFIER_UNSPECIFIED,
    "dapo": reward_pb2.VERIFIER_DAPO,
    "math_verify": reward_pb2.VERIFIER_MATH_VERIFY,
    "cascade": reward_pb2.VERIFIER_CASCADE,
    "first_integer": reward_pb2.VERIFIER_FIRST_INTEGER,
}


def generate_request(
    request_id: str,
    record: PromptRecord,
    n: int,
    sampling: SamplingConfig,
    max_tokens: int,
    tokenizer_fingerprint: str,
    seed: int = 0,
    min_version: int = 0,
    priority: int = 0,
) -> rollout_pb2.GenerateRequest:
    """The request for `record`'s prompt, as the token ids rendered at load."""
    if not record.prompt_token_ids:
        raise ValueError(f"prompt {record.prompt_id} was not tokenized at load")
    return rollout_pb2.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=record.prompt_token_ids,
        tokenizer_fingerprint=tokenizer_fingerprint,
        n=n,
        min_version=min_version,
        priority=priority,
        sampling=rollout_pb2.SamplingParams(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=max(sampling.top_k, 0),
            max_tokens=max_tokens,
            seed=seed,
        ),
    )


def samples_from_group(
    response: rollout_pb2.GenerateGroupResponse, n: int
) -> tuple[list[int], list[Sample]]:
    """The group's samples in index order; check exactly n arrived."""
    if len(response.completions) != n:
        raise ValueError(f"expected {n} samples, got {len(response.completions)}")
    return list(response.prompt_token_ids), [
        sample_from_completion(c) for c in response.completions
    ]


def samples_from_groups(
    response: rollout_pb2.GenerateGroupsResponse, batch: rollout_pb2.GenerateGroupsRequest
) -> list[tuple[list[int], list[Sample]]]:
    """Each asked group's samples, in request order (ValueError if the answer differs)."""
    asked = [r.request_id for r in batch.groups]
    answered = [g.request_id for g in response.groups]
    if answered != asked:
        raise ValueError(f"asked for groups {asked}, answered {answered}")
    return [samples_from_group(g, r.n) for g, r in zip(response.groups, batch.groups, strict=True)]


def score_request(
    samples: list[Sample], ground_truth: str, verifier: str, group_id: str
) -> reward_pb2.ScoreRequest:
    return reward_pb2.ScoreRequest(
        items=[
            reward_pb2.ScoreItem(
                id=f"{group_id}/{i}",
                response=s.text,
                ground_truth=ground_truth,
                verifier=VERIFIERS[verifier],
                response_length=len(s.token_ids),
                truncated=s.truncated,
            )
            for i, s in enumerate(samples)
        ]
    )


def apply_scores(samples: list[Sample], response: reward_pb2.ScoreResponse) -> None:
    """Copy each verdict onto its sample (results come back in request order)."""
    if len(response.results) != len(samples):
        raise ValueError(f"{len(response.results)} results for {len(samples)} items")
    for sample, result in zip(samples, response.results, strict=True):
        sample.reward = result.reward
        sample.correct = result.correct
        sample.pred = result.pred
        sample.overlong_penalty = result.overlong_penalty
        sample.error = result.error
