"""Frames received in place (services/weight_transport/frame_reader.py): the same tensors as the
copying path, bitwise, the data landing in their tensors while the frame still arrives,
and every malformed frame refused (never read differently from `parse_bucket`)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from dapo.v1 import tensor_pb2
from services.weight_transport.assembly import Assembling, SliceMeta, WeightAssembler
from services.weight_transport.frame_reader import PlacedBuckets
from services.weight_transport.tensor_codec import (
    TensorWireError,
    encode_bucket_bytes,
    parse_bucket,
)
from services.weight_transport.torch_codec import from_torch, to_torch
from services.weight_transport.weight_socket import FRAME, WeightSocketError


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {
        "emb": torch.randn(50, 24, generator=gen).to(torch.bfloat16),
        "w": torch.randn(7, 5, generator=gen),
        "steps": torch.arange(9, dtype=torch.int64),
        "empty": torch.zeros(0, 4),
        "scale": torch.tensor(2.5, dtype=torch.float16),
    }


def _frames(bucket_bytes: int, tensors: dict[str, torch.Tensor] | None = None) -> list[bytes]:
    raws = [from_torch(n, t) for n, t in (tensors or _tensors()).items()]
    return list(encode_bucket_bytes(raws, 4, bucket_bytes))


def _stream(frames: list[bytes], end: bool = True) -> Iterator[socket.socket]:
    """A real socket that delivers `frames` (length-prefixed, then the end marker)."""
    reader, writer = socket.socketpair()

    def send() -> None:
        with writer, contextlib.suppress(OSError):  # the reader may refuse and hang up
            for frame in frames:
                writer.sendall(FRAME.pack(len(frame)) + frame)
            if end:
                writer.sendall(FRAME.pack(0))

    threading.Thread(target=send, daemon=True).start()
    reader.settimeout(10)
    yield reader


def _receive(frames: list[bytes], end: bool = True) -> tuple[list[int], WeightAssembler]:
    placed = PlacedBuckets(next(_stream(frames, end)), 1 << 24)
    indices = [bucket.index for bucket, _ in placed]
    return indices, placed.assembler


@pytest.mark.parametrize("bucket_bytes", [1, 7, 100, 5000, 1 << 20])
def test_in_place_is_bitwise_the_published_tensors(bucket_bytes: int) -> None:
    frames = _frames(bucket_bytes)
    indices, assembler = _receive(frames)
    assert indices == list(range(len(frames)))
    out = {raw.name: to_torch(raw) for raw in assembler.result()}
    for name, tensor in _tensors().items():
        assert out[name].dtype == tensor.dtype and out[name].shape == tensor.shape
        assert torch.equal(out[name].view(-1).view(torch.uint8), tensor.view(-1).view(torch.uint8))


class Watching(WeightAssembler):
    """An assembler that remembers where it placed each slice."""

    def __init__(self) -> None:
        super().__init__()
        self.placed: list[memoryview] = []

    def reserve(self, meta: SliceMeta, length: int) -> memoryview:
        view = super().reserve(meta, length)
        self.placed.append(view)
        return view


def test_the_data_land_in_their_tensor_while_the_frame_arrives() -> None:
    """No frame buffer in between: half a frame sent, its bytes already sit in the tensor."""
    data = torch.arange(1 << 18, dtype=torch.int32)  # 1 MiB, one slice
    (frame,) = _frames(1 << 21, {"w": data})
    reader, writer = socket.socketpair()
    half = len(frame) // 2
    assembler = Watching()
    placed = PlacedBuckets(reader, 1 << 24, assembler)
    items: list[object] = []
    thread = threading.Thread(target=lambda: items.extend(placed), daemon=True)
    thread.start()
    writer.sendall(FRAME.pack(len(frame)) + frame[:half])
    deadline, expected = time.monotonic() + 10, data.numpy().tobytes()
    prefix = half - (len(frame) - len(expected))  # data bytes inside the first half
    while time.monotonic() < deadline:
        if assembler.placed and bytes(assembler.placed[0][:prefix]) == expected[:prefix]:
            break
        time.sleep(0.01)
    assert bytes(assembler.placed[0][:prefix]) == expected[:prefix] and not items
    writer.sendall(frame[half:] + FRAME.pack(0))
    thread.join(10)
    assert len(items) == 1
    (raw,) = assembler.result()
    assert torch.equal(to_torch(raw), data)
    writer.close()


def _copying(frames: list[bytes]) -> list[tuple[str, bytes]]:
    items = Assembling.of_frames(frames)
    list(items)
    return [(r.name, bytes(r.data)) for r in items.assembler.result()]


def _in_place(frames: list[bytes]) -> list[tuple[str, bytes]]:
    _, assembler = _receive(frames)
    return [(r.name, bytes(r.data)) for r in assembler.result()]


def test_a_mangled_frame_is_refused_or_read_as_the_copying_path_reads_it() -> None:
    """Every single-byte change and truncation of a one-frame update: the in-place reader
    either refuses it or gets exactly what parse_bucket + the assembler get, and refuses
    whatever they refuse."""
    (frame,) = _frames(1 << 20, {"a": torch.arange(6, dtype=torch.int16), "b": torch.ones(3)})
    cases = [frame[:cut] for cut in range(len(frame))]
    for at in range(len(frame)):
        for value in (0x00, 0x7F, 0x80, 0xFF, frame[at] ^ 0x01):
            cases.append(frame[:at] + bytes([value]) + frame[at + 1 :])
    outcomes = {"same": 0, "refused": 0}
    for case in cases:
        try:
            expected = _copying([case])
        except TensorWireError:
            expected = None
        try:
            got = _in_place([case])
        except (TensorWireError, WeightSocketError):
            outcomes["refused"] += 1
            continue
        assert got == expected, case
        outcomes["same"] += 1
    assert outcomes["same"] > 0 and outcomes["refused"] > len(frame)


def test_data_before_a_slices_metadata_parses_but_is_refused_in_place() -> None:
    """Valid protobuf in an order no serializer writes: `parse_bucket` (FetchWeights)
    reads any order; the in-place reader needs the metadata first and says so."""
    data = torch.arange(6, dtype=torch.int32)
    piece = tensor_pb2.TensorSlice(data=data.numpy().tobytes()).SerializeToString()
    piece += tensor_pb2.TensorSlice(
        name="x", dtype=tensor_pb2.DTYPE_INT32, shape=[2, 3], total_bytes=24
    ).SerializeToString()
    message = tensor_pb2.WeightBucket(total_tensors=1, last=True, version=3).SerializeToString()
    message += b"\x22" + bytes([len(piece)]) + piece
    bucket = parse_bucket(message)
    assert (bucket.version, bucket.index, bucket.last, bucket.total_tensors) == (3, 0, True, 1)
    assert _copying([message]) == [("x", data.numpy().tobytes())]
    with pytest.raises(TensorWireError, match="metadata|last field"):
        _in_place([message])


def test_a_stream_cut_inside_a_frame_or_a_frame_over_the_limit_is_an_error() -> None:
    frames = _frames(100)
    reader, writer = socket.socketpair()
    writer.sendall(FRAME.pack(len(frames[0])) + frames[0][:-5])
    writer.close()
    with pytest.raises(WeightSocketError, match="closed"):
        list(PlacedBuckets(reader, 1 << 24))
    with pytest.raises(WeightSocketError, match="exceeds the limit"):
        list(PlacedBuckets(next(_stream(frames)), 50))
