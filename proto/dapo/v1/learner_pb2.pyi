from dapo.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class GetVersionRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetVersionResponse(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class FetchWeightsRequest(_message.Message):
    __slots__ = ("version", "bucket_bytes")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BYTES_FIELD_NUMBER: _ClassVar[int]
    version: int
    bucket_bytes: int
    def __init__(self, version: _Optional[int] = ..., bucket_bytes: _Optional[int] = ...) -> None: ...

class WeightSocketTicket(_message.Message):
    __slots__ = ("version", "port", "ticket")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    version: int
    port: int
    ticket: bytes
    def __init__(self, version: _Optional[int] = ..., port: _Optional[int] = ..., ticket: _Optional[bytes] = ...) -> None: ...
