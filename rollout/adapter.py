"""The rollout service's one translation between protobuf and engine types."""

from __future__ import annotations

from dapo.v1 import rollout_pb2
from rollout.engine import SampleOutput, SamplingParams
from services.common.adapters import FINISH_TO_PROTO, packed_tokens
from services.common.settings import SamplingConfig


def sampling_params(
    msg: rollout_pb2.SamplingParams, n: int, defaults: SamplingConfig, max_tokens: int
) -> SamplingParams:
    """Engine params from a request; zero values take the server's defaults."""
    return SamplingParams(
        n=n,
        temperature=msg.temperature if msg.HasField("temperature") else defaults.temperature,
        top_p=msg.top_p or defaults.top_p,
        top_k=msg.top_k if msg.top_k > 0 else defaults.top_k,
        max_tokens=msg.max_tokens or max_tokens,
        stop_token_ids=tuple(msg.stop_token_ids),
        seed=msg.seed or None,
    )


def completion(output: SampleOutput, text: str) -> rollout_pb2.Completion:
    """Per-token versions go on the wire only when they differ (empty = all the same)."""
    versions = output.token_versions  # empty: every token is policy_version's (engines)
    mixed = len(versions) > 1 and bool((versions != versions[0]).any())
    return rollout_pb2.Completion(
        text=text,
        finish_reason=FINISH_TO_PROTO[output.finish_reason],
        policy_version=int(versions.min()) if len(versions) else output.policy_version,
        **packed_tokens(output.token_ids, output.logprobs, versions if mixed else versions[:0]),
    )
