"""The one translation between protobuf records and internal dataclasses.

Business code handles `Group` / `Sample`; only this module touches records_pb2 and the
Completion message.
"""

from __future__ import annotations

import numpy as np

from dapo.v1 import records_pb2, rollout_pb2
from services.common.types import (
    FinishReason,
    FloatArray,
    Group,
    IntArray,
    Sample,
)

FINISH_TO_PROTO: dict[str, int] = {
    "stop": rollout_pb2.FINISH_REASON_STOP,
    "length": rollout_pb2.FINISH_REASON_LENGTH,
    "abort": rollout_pb2.FINISH_REASON_ABORT,
}
FINISH_FROM_PROTO: dict[int, FinishReason] = {v: k for k, v in FINISH_TO_PROTO.items()}  # type: ignore[misc]


def packed_tokens(
    token_ids: IntArray, logprobs: FloatArray, token_versions: IntArray
) -> dict[str, bytes]:
    """The Completion's packed little-endian array fields (see rollout.proto)."""
    return {
        "token_ids_i32": token_ids.astype("<i4", copy=False).tobytes(),
        "logprobs_f32": logprobs.astype("<f4", copy=False).tobytes(),
        "token_versions_i64": token_versions.astype("<i8", copy=False).tobytes(),
    }


def completion_to_proto(sample: Sample) -> rollout_pb2.Completion:
    return rollout_pb2.Completion(
        text=sample.text,
        finish_reason=FINISH_TO_PROTO[sample.finish_reason],
        policy_version=sample.policy_version,
        **packed_tokens(sample.token_ids, sample.logprobs, sample.token_versions),
    )


_ITEM_SIZES = {"<i4": 4, "<f4": 4, "<i8": 8}


def _unpack(data: bytes, dtype: str, what: str, to: type[np.generic]) -> np.ndarray:
    """A packed field as a new (writable: torch.from_numpy shares it) array of `to`."""
    if not data:  # token versions, for every sample of one version: skip numpy's calls
        return np.empty(0, dtype=to)
    size = _ITEM_SIZES[dtype]
    if len(data) % size:
        raise ValueError(f"completion {what}: {len(data)} bytes, not a multiple of {size}")
    return np.frombuffer(data, dtype=dtype).astype(to)  # one copy, already the record's type


def sample_from_completion(msg: rollout_pb2.Completion) -> Sample:
    """An unscored Sample from a rollout Completion."""
    if msg.finish_reason not in FINISH_FROM_PROTO:
        raise ValueError(f"completion has no finish reason ({msg.finish_reason})")
    token_ids = _unpack(msg.token_ids_i32, "<i4", "token ids", np.int64)
    logprobs = _unpack(msg.logprobs_f32, "<f4", "log-probs", np.float32)
    versions = _unpack(msg.token_versions_i64, "<i8", "token versions", np.int64)
    if len(versions) and len(versions) != len(token_ids):
        raise ValueError(
            f"completion has {len(versions)} token versions for {len(token_ids)} tokens"
        )
    return Sample(
        token_ids=token_ids,
        logprobs=logprobs,
        text=msg.text,
        finish_reason=FINISH_FROM_PROTO[msg.finish_reason],
        policy_version=int(versions.min()) if len(versions) else msg.policy_version,
        token_versions=versions,
        truncated=msg.finish_reason == rollout_pb2.FINISH_REASON_LENGTH,
    )


def group_to_proto(group: Group) -> records_pb2.ScoredGroup:
    return records_pb2.ScoredGroup(
        group_id=group.group_id,
        run_id=group.run_id,
        prompt_id=group.prompt_id,
        epoch=group.epoch,
        prompt=group.prompt,
        prompt_token_ids=group.prompt_token_ids,
        ground_truth=group.ground_truth,
        admitted_version=group.admitted_version,
        admitted_at=group.admitted_at,
        scored_at=group.scored_at,
        data_source=group.data_source,
        samples=[
            records_pb2.ScoredSample(
                completion=completion_to_proto(s),
                reward=s.reward,
                correct=s.correct,
                pred=s.pred,
                truncated=s.truncated,
                overlong_penalty=s.overlong_penalty,
                error=s.error,
            )
            for s in group.samples
        ],
    )


def group_from_proto(msg: records_pb2.ScoredGroup) -> Group:
    samples = []
    for s in msg.samples:
        sample = sample_from_completion(s.completion)
        sample.reward, sample.correct, sample.pred = s.reward, s.correct, s.pred
        sample.truncated, sample.overlong_penalty, sample.error = (
            s.truncated,
            s.overlong_penalty,
            s.error,
        )
        samples.append(sample)
    return Group(
        group_id=msg.group_id,
        prompt_id=msg.prompt_id,
        prompt=msg.prompt,
        prompt_token_ids=list(msg.prompt_token_ids),
        ground_truth=msg.ground_truth,
        samples=samples,
        run_id=msg.run_id,
        epoch=msg.epoch,
        admitted_version=msg.admitted_version,
        admitted_at=msg.admitted_at,
        scored_at=msg.scored_at,
        data_source=msg.data_source,
    )


def encode_group(group: Group) -> bytes:
    """Bytes for a Redis stream entry."""
    return group_to_proto(group).SerializeToString()


def decode_group(data: bytes) -> Group:
    """Parse a stream entry; raises ValueError on malformed bytes."""
    msg = records_pb2.ScoredGroup()
    try:
        msg.ParseFromString(data)
    except Exception as exc:  # protobuf raises DecodeError, a subclass of Exception
        raise ValueError(f"malformed ScoredGroup: {exc}") from None
    return group_from_proto(msg)
