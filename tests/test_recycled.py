"""Received tensors' memory is reused by size once nothing views it
(services/weight_transport/recycled.py): never while a view lives, always after."""

from __future__ import annotations

import gc

import torch

from services.weight_transport.assembly import WeightAssembler
from services.weight_transport.recycled import RecycledBuffers
from services.weight_transport.tensor_codec import encode_buckets
from services.weight_transport.torch_codec import from_torch, to_torch

MB = 1 << 20


def test_a_buffer_is_reused_only_once_its_last_view_is_gone() -> None:
    pool = RecycledBuffers()
    first = pool.take(3 * MB)
    first[:] = 7
    view, tensor = memoryview(first)[10:20], torch.frombuffer(first, dtype=torch.uint8)
    address = first.ctypes.data
    del first
    other = pool.take(3 * MB)  # the views still hold the first buffer
    assert other.ctypes.data != address and pool.free_bytes() == 0
    other[:] = 1
    assert bytes(view) == b"\x07" * 10 and int(tensor.sum()) == 7 * 3 * MB
    del view
    assert pool.free_bytes() == 0  # the tensor still holds it
    del tensor
    gc.collect()
    assert pool.free_bytes() == 3 * MB
    again = pool.take(3 * MB)
    assert again.ctypes.data == address and again.flags.writeable
    assert pool.mapped == 6 * MB  # two buffers ever mapped


def test_small_buffers_come_from_malloc() -> None:
    pool = RecycledBuffers()
    small = pool.take(MB - 1)
    assert small.nbytes == MB - 1 and pool.mapped == 0


def test_received_versions_reuse_the_same_memory_at_every_swap() -> None:
    """A rollout server's pattern: version N arrives while N - 1 is served, then N - 1 is
    dropped. Two versions' worth is mapped, then nothing more, and every version is
    exact."""
    pool, gen = RecycledBuffers(), torch.Generator().manual_seed(0)
    shapes = {"emb": (512, 1024), "w1": (1024, 600), "w2": (600, 1024), "norm": (1024,)}
    served = None
    mapped = []
    for version in range(1, 7):
        sent = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
        assembler = WeightAssembler(allocate=pool.take)
        for bucket in encode_buckets([from_torch(n, t) for n, t in sent.items()], version, MB):
            assembler.add(bucket)
        received = {raw.name: to_torch(raw) for raw in assembler.result()}
        assert all(torch.equal(received[n], t) for n, t in sent.items())
        served = received  # the swap: the version before is let go
        del assembler, received
        mapped.append(pool.mapped)
    assert served is not None
    big = sum(torch.Size(s).numel() * 4 for s in shapes.values() if len(s) > 1)
    assert mapped[1] == 2 * big and mapped[-1] == mapped[1], mapped
