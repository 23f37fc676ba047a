"""Data-parallel plumbing for the learner: sums across ranks and the batch broadcast.

The DAPO step only needs three collectives: a sum (token counts, metric totals), a max
(the common micro-batch count) and, in the service, rank 0 sending the serialized batch
to the other ranks. `Single` is the world-size-1 no-op; `TorchDist` uses
torch.distributed (gloo on CPU, NCCL on GPU). The batch travels as a uint8 tensor of
length-prefixed protobuf bytes — never pickle (`broadcast_object_list` pickles).
"""

from __future__ import annotations

import os
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
    """torch.distributed's default group; `device` is where its backend wants the tensors."""

    def __init__(self, device: torch.device) -> None:
        import torch.distributed as dist

        self.dist, self.device = dist, device
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


def data_parallel() -> DataParallel:
    """`TorchDist` when torch.distributed is up with more than one rank (its tensors where
    the group's backend needs them), else `Single`."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return TorchDist(backend_device(str(dist.get_backend()), local_rank()))
    return Single()


# ------------------------------------------------------------------ devices, decided once
def local_rank() -> int:
    """This process's rank on its machine (torchrun's LOCAL_RANK; 0 alone)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def backend_device(backend: str, rank: int) -> torch.device:
    """Where a group's collectives take their tensors: NCCL only moves CUDA tensors (the
    rank's own GPU); gloo moves CPU tensors. A group of both ("cpu:gloo,cuda:nccl")
    takes the GPU's."""
    names = {part.rpartition(":")[2] for part in backend.lower().split(",")}
    return torch.device("cuda", rank) if "nccl" in names else torch.device("cpu")


def learner_device(setting: str, cuda_available: bool, rank: int) -> torch.device:
    """`learner.device` made concrete: auto is the rank's GPU when CUDA is present, else
    the CPU; `cuda` is the rank's GPU; `cuda:N` and `cpu` are taken as they are."""
    if setting == "auto":
        setting = "cuda" if cuda_available else "cpu"
    if setting.startswith("cuda") and not cuda_available:
        raise DapoError(f"learner.device={setting}, but CUDA is not available here")
    return torch.device("cuda", rank) if setting == "cuda" else torch.device(setting)


def this_rank_device(setting: str) -> torch.device:
    """`learner_device` for this process."""
    return learner_device(setting, torch.cuda.is_available(), local_rank())


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
