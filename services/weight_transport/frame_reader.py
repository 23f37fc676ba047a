"""A weight socket's frames received straight into the tensors they carry.

Each slice's metadata is parsed as it arrives and its data `recv_into` their place in the
tensor (`WeightAssembler.reserve`), so the kernel's copy is the only one. A slice's `data`
must be its last field (as every protobuf serializer writes it); anything else, and every
malformed frame, is refused with `TensorWireError`. Details: docs/weight_publication.md,
"The path" (received in place).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

from dapo.v1 import tensor_pb2
from services.weight_transport.assembly import Assembled, AssembledBuckets, WeightAssembler
from services.weight_transport.tensor_codec import (
    DATA_KEY,
    FIXED_WIDTHS,
    SLICES_KEY,
    SliceMeta,
    TensorWireError,
    WireBucket,
    WireSlice,
    from_string,
    read_varint,
)
from services.weight_transport.weight_socket import WeightSocketError, frame_size, recv_exact

STAGE_BYTES = 4096  # read ahead for metadata; the data past it land in place


class _Frame:
    """The unread rest of one frame on a socket, with a small read-ahead for metadata."""

    def __init__(self, sock: socket.socket, size: int, stage: memoryview) -> None:
        self.sock, self.unread, self.stage = sock, size, stage  # unread: still in the socket
        self.pos = self.end = 0

    @property
    def left(self) -> int:
        """Bytes of the frame not yet consumed."""
        return self.unread + self.end - self.pos

    def _fill(self) -> None:
        want = min(len(self.stage), self.unread)
        if want == 0:
            raise TensorWireError("weight bucket truncated")
        got = self.sock.recv_into(self.stage[:want], want)
        if not got:
            raise WeightSocketError("weight socket closed inside a frame")
        self.pos, self.end, self.unread = 0, got, self.unread - got

    def byte(self) -> int:
        if self.pos == self.end:
            self._fill()
        self.pos += 1
        return self.stage[self.pos - 1]

    def take(self, n: int) -> bytes:
        """The next `n` bytes (metadata: small)."""
        if n > self.left:
            raise TensorWireError("weight bucket truncated")
        out = bytearray()
        while len(out) < n:
            if self.pos == self.end:
                self._fill()
            step = min(n - len(out), self.end - self.pos)
            out += self.stage[self.pos : self.pos + step]
            self.pos += step
        return bytes(out)

    def into(self, view: memoryview) -> None:
        """The next len(view) bytes into `view`: what the read-ahead holds, then the rest
        straight from the socket."""
        if len(view) > self.left:
            raise TensorWireError("weight bucket truncated")
        staged = min(len(view), self.end - self.pos)
        view[:staged] = self.stage[self.pos : self.pos + staged]
        self.pos += staged
        rest = len(view) - staged
        if rest:
            recv_exact(self.sock, rest, view[staged:])
            self.unread -= rest

    def varint(self) -> tuple[int, bytes]:
        """(value, its encoding)."""
        raw = bytearray([self.byte()])
        while raw[-1] >= 0x80 and len(raw) < 10:  # a varint of 64 bits takes 10 bytes
            raw.append(self.byte())
        return read_varint(memoryview(raw), 0)[0], bytes(raw)

    def field(self, key: int, key_bytes: bytes) -> bytes:
        """A whole field (key included) whose key was just read, for protobuf to parse."""
        wire_type = key & 7
        if wire_type == 0:
            return key_bytes + self.varint()[1]
        if wire_type == 2:
            length, length_bytes = self.varint()
            return key_bytes + length_bytes + self.take(length)
        if wire_type in FIXED_WIDTHS:
            return key_bytes + self.take(FIXED_WIDTHS[wire_type])
        raise TensorWireError(f"unsupported wire type {wire_type} in weight bucket")


def read_bucket(
    sock: socket.socket, size: int, assembler: WeightAssembler, stage: memoryview
) -> tuple[WireBucket, list[memoryview]]:
    """One frame of `size` bytes, its slices' data received where `assembler` places them:
    (the bucket, the views its data landed in), for `assembler.add_placed`."""
    frame, header = _Frame(sock, size, stage), []
    slices: list[WireSlice] = []
    while frame.left:
        key, key_bytes = frame.varint()
        if key != SLICES_KEY:
            header.append(frame.field(key, key_bytes))
            continue
        length = frame.varint()[0]
        if length > frame.left:
            raise TensorWireError("weight bucket truncated")
        slices.append(_read_slice(frame, frame.left - length, assembler))
    h = from_string(tensor_pb2.WeightBucket, b"".join(header))
    bucket = WireBucket(h.version, h.index, h.last, h.total_tensors, slices)
    return bucket, [s.data for s in slices]  # type: ignore[misc]


def _read_slice(frame: _Frame, stop: int, assembler: WeightAssembler) -> WireSlice:
    """One TensorSlice, ending where `frame.left` reaches `stop`."""
    meta: list[bytes] = []
    view: memoryview | None = None
    while frame.left > stop:
        key, key_bytes = frame.varint()
        if view is not None:
            raise TensorWireError("a slice's data must be its last field")
        if key == DATA_KEY:
            if not meta:
                raise TensorWireError("a slice's data came before its metadata")
            length = frame.varint()[0]
            if length > frame.left - stop:
                raise TensorWireError("weight bucket truncated")
            view = assembler.reserve(_meta(meta), length)
            frame.into(view)
        else:
            meta.append(frame.field(key, key_bytes))
    if frame.left < stop:
        raise TensorWireError("a field runs past the end of its slice")
    m = _meta(meta)
    if view is None:
        view = assembler.reserve(m, 0)
    return WireSlice(m.name, m.dtype, m.shape, m.offset, m.total_bytes, view)


def _meta(fields: list[bytes]) -> SliceMeta:
    return SliceMeta.of(from_string(tensor_pb2.TensorSlice, b"".join(fields)))


class PlacedBuckets(AssembledBuckets):
    """A weight socket's stream, each frame received into `assembler`'s tensors and
    yielded as `Assembled`. Closes the socket at the end, or on `close`/`abandon`."""

    def __init__(
        self,
        sock: socket.socket,
        max_frame_bytes: int,
        assembler: WeightAssembler | None = None,
        first_timeout: float | None = None,
    ) -> None:
        self.sock, self.max_frame_bytes = sock, max_frame_bytes
        self.assembler = assembler or WeightAssembler()
        self.first_timeout = first_timeout  # for the first frame (a relay may wait longer)

    def __iter__(self) -> Iterator[Assembled]:
        stage = memoryview(bytearray(STAGE_BYTES))
        timeout = self.sock.gettimeout()
        try:
            if self.first_timeout is not None:
                self.sock.settimeout(self.first_timeout)
            while size := frame_size(self.sock, self.max_frame_bytes):
                bucket, views = read_bucket(self.sock, size, self.assembler, stage)
                self.sock.settimeout(timeout)  # the first frame may wait longer, not the rest
                self.assembler.add_placed(bucket, views)
                yield bucket, self.assembler.pop_completed()
        except OSError as exc:  # a reset, a timeout, a TLS alert
            raise WeightSocketError(f"weight socket failed: {exc}") from exc
        finally:
            self.sock.close()

    def close(self) -> None:
        self.sock.close()
