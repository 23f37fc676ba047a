from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Verifier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VERIFIER_UNSPECIFIED: _ClassVar[Verifier]
    VERIFIER_DAPO: _ClassVar[Verifier]
    VERIFIER_MATH_VERIFY: _ClassVar[Verifier]
    VERIFIER_CASCADE: _ClassVar[Verifier]
    VERIFIER_FIRST_INTEGER: _ClassVar[Verifier]
VERIFIER_UNSPECIFIED: Verifier
VERIFIER_DAPO: Verifier
VERIFIER_MATH_VERIFY: Verifier
VERIFIER_CASCADE: Verifier
VERIFIER_FIRST_INTEGER: Verifier

class ScoreItem(_message.Message):
    __slots__ = ("id", "response", "ground_truth", "verifier", "response_length", "truncated")
    ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    GROUND_TRUTH_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    id: str
    response: str
    ground_truth: str
    verifier: Verifier
    response_length: int
    truncated: bool
    def __init__(self, id: _Optional[str] = ..., response: _Optional[str] = ..., ground_truth: _Optional[str] = ..., verifier: _Optional[_Union[Verifier, str]] = ..., response_length: _Optional[int] = ..., truncated: _Optional[bool] = ...) -> None: ...

class ScoreResult(_message.Message):
    __slots__ = ("id", "reward", "correct", "pred", "verifier", "error", "overlong_penalty", "truncated")
    ID_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    CORRECT_FIELD_NUMBER: _ClassVar[int]
    PRED_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    OVERLONG_PENALTY_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    id: str
    reward: float
    correct: bool
    pred: str
    verifier: Verifier
    error: str
    overlong_penalty: float
    truncated: bool
    def __init__(self, id: _Optional[str] = ..., reward: _Optional[float] = ..., correct: _Optional[bool] = ..., pred: _Optional[str] = ..., verifier: _Optional[_Union[Verifier, str]] = ..., error: _Optional[str] = ..., overlong_penalty: _Optional[float] = ..., truncated: _Optional[bool] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ScoreItem]
    def __init__(self, items: _Optional[_Iterable[_Union[ScoreItem, _Mapping]]] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ScoreResult]
    def __init__(self, results: _Optional[_Iterable[_Union[ScoreResult, _Mapping]]] = ...) -> None: ...
