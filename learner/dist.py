"""Data-parallel plumbing for the learner: sums across ranks and the batch broadcast.

The DAPO step only needs three collectives: a sum (token counts, metric totals), a max
(the common micro-batch count) and, in the service, rank 0 sending the serialized batch
to the other ranks. `Single` is the world-size-1 no-op; `TorchDist` uses
torch.distributed (gloo on CPU, NCCL on GPU). The batch travels as a uint8 tensor of
length-prefixed protobuf bytes — never pickle (`broadcast_object_list` pickles).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor

from services.common.adapters import decode_group, encode_group
from services.common.errors import DapoError
from services.common.types import Group


class DataParallel(Protocol):
    """The collectives the DAPO step uses."""

    rank: int
    world_size: int

    def all_reduce_sum(self, t: Tensor) -> Tensor: ...

    def all_reduce_max(self, value: int) -> int: ...

    def broadcast_bytes(self, payload: bytes | None) -> bytes: ...

    def close(self) -> None:
        """Every rank done with the group (call on all ranks at a clean stop)."""
        ...


class Single:
    """One process: every collective is the identity."""

    rank, world_size = 0, 1

    def all_reduce_sum(self, t: Tensor) -> Tensor:
        return t

    def all_reduce_max(self, value: int) -> int:
        return value

    def broadcast_bytes(self, payload: bytes | None) -> bytes:
        """The payload itself; a follower (payload None) has no rank 0 to hear from."""
        if payload is None:
            raise DapoError(
                "a follower rank started without torch.distributed: data parallelism needs "
                "learner.engine=deepspeed (any deepspeed.zero_stage), launched with torchrun"
            )
        return payload

    def close(self) -> None:
        pass


class TorchDist:
    """torch.distributed's default group; `device` is where NCCL wants the tensors."""

    def __init__(self, device: str = "cpu") -> None:
        import torch.distributed as dist

        self.dist, self.device = dist, torch.device(device)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    def all_reduce_sum(self, t: Tensor) -> Tensor:
        out = t.to(self.device).clone()
        self.dist.all_reduce(out, op=self.dist.ReduceOp.SUM)
        return out.to(t.device)

    def all_reduce_max(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return int(t.item())

    def broadcast_bytes(self, payload: bytes | None) -> bytes:
        """Rank 0's `payload` on every rank: its length first, then the bytes as uint8."""
        size = torch.tensor([len(payload) if payload is not None else 0], device=self.device)
        self.dist.broadcast(size, src=0)
        if self.rank == 0:
            if payload is None:
                raise ValueError("rank 0 must broadcast a payload")
            buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device)
        else:
            buf = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        if buf.numel():
            self.dist.broadcast(buf, src=0)
        return buf.cpu().numpy().tobytes()

    def close(self) -> None:
        """A barrier, then the group destroyed. Left to interpreter exit, gloo's teardown
        took ~10 s per rank (torchrun's SIGKILL deadline counts it), and a rank exiting
        while its peer's gloo threads still talk to it can abort the peer."""
        self.dist.barrier()
        self.dist.destroy_process_group()


def data_parallel(device: str = "cpu") -> DataParallel:
    """`TorchDist` when torch.distributed is up with more than one rank, else `Single`."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return TorchDist(device)
    return Single()


# ------------------------------------------------------------------ the batch on the wire
def pack_groups(groups: Sequence[Group]) -> bytes:
    """Groups as `<u32 length><ScoredGroup protobuf>` records."""
    parts = []
    for group in groups:
        data = encode_group(group)
        parts.append(struct.pack("<I", len(data)) + data)
    return b"".join(parts)


def unpack_groups(payload: bytes) -> list[Group]:
    """Inverse of `pack_groups`; raises ValueError on a truncated record."""
    groups, pos = [], 0
    while pos < len(payload):
        if pos + 4 > len(payload):
            raise ValueError("truncated group record header")
        (size,) = struct.unpack_from("<I", payload, pos)
        pos += 4
        if pos + size > len(payload):
            raise ValueError("truncated group record")
        groups.append(decode_group(payload[pos : pos + size]))
        pos += size
    return groups
