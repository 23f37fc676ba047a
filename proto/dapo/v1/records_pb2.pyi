from dapo.v1 import rollout_pb2 as _rollout_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ScoredSample(_message.Message):
    __slots__ = ("completion", "reward", "correct", "pred", "truncated", "overlong_penalty", "error")
    COMPLETION_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    CORRECT_FIELD_NUMBER: _ClassVar[int]
    PRED_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    OVERLONG_PENALTY_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    completion: _rollout_pb2.Completion
    reward: float
    correct: bool
    pred: str
    truncated: bool
    overlong_penalty: float
    error: str
    def __init__(self, completion: _Optional[_Union[_rollout_pb2.Completion, _Mapping]] = ..., reward: _Optional[float] = ..., correct: _Optional[bool] = ..., pred: _Optional[str] = ..., truncated: _Optional[bool] = ..., overlong_penalty: _Optional[float] = ..., error: _Optional[str] = ...) -> None: ...

class ScoredGroup(_message.Message):
    __slots__ = ("group_id", "run_id", "prompt_id", "epoch", "prompt", "prompt_token_ids", "ground_truth", "samples", "admitted_version", "admitted_at", "scored_at", "data_source")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    GROUND_TRUTH_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_VERSION_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_AT_FIELD_NUMBER: _ClassVar[int]
    SCORED_AT_FIELD_NUMBER: _ClassVar[int]
    DATA_SOURCE_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    run_id: str
    prompt_id: str
    epoch: int
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ground_truth: str
    samples: _containers.RepeatedCompositeFieldContainer[ScoredSample]
    admitted_version: int
    admitted_at: float
    scored_at: float
    data_source: str
    def __init__(self, group_id: _Optional[str] = ..., run_id: _Optional[str] = ..., prompt_id: _Optional[str] = ..., epoch: _Optional[int] = ..., prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., ground_truth: _Optional[str] = ..., samples: _Optional[_Iterable[_Union[ScoredSample, _Mapping]]] = ..., admitted_version: _Optional[int] = ..., admitted_at: _Optional[float] = ..., scored_at: _Optional[float] = ..., data_source: _Optional[str] = ...) -> None: ...
