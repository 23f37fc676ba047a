"""torch tensors and `RawTensor` (services/weight_transport/tensor_codec.py), both ways: torch is
imported only inside these functions, so modules that never touch tensors stay torch-free."""

from __future__ import annotations

from typing import Any

from services.weight_transport.tensor_codec import RawTensor


def from_torch(name: str, tensor: Any) -> RawTensor:
    """A torch tensor → RawTensor (copies to CPU, contiguous)."""
    import torch

    t = tensor.detach().to("cpu").contiguous()
    dtype = str(t.dtype).removeprefix("torch.")
    data = t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return RawTensor(name, dtype, tuple(t.shape), data)


def torch_view(name: str, tensor: Any) -> RawTensor:
    """A torch tensor → RawTensor viewing its CPU memory (copies only off-CPU or
    non-contiguous tensors): valid while the tensor is unchanged."""
    import torch

    t = tensor.detach().to("cpu").contiguous()
    dtype = str(t.dtype).removeprefix("torch.")
    data = memoryview(t.view(-1).view(torch.uint8).numpy()) if t.numel() else b""
    return RawTensor(name, dtype, tuple(t.shape), data)


def to_torch(raw: RawTensor) -> Any:
    """RawTensor → a CPU torch tensor.

    A writable buffer (a bytearray, or the memoryview `WeightAssembler` returns) is used
    in place, not copied: the tensor shares its memory. Read-only buffers are copied so
    the tensor owns writable memory.
    """
    import torch

    dtype = getattr(torch, raw.dtype)  # probe-ok: torch's dtype by its name (DTYPE_NAMES)
    if not len(raw.data):
        return torch.empty(raw.shape, dtype=dtype)
    writable = isinstance(raw.data, bytearray) or (
        isinstance(raw.data, memoryview) and not raw.data.readonly
    )
    buf = raw.data if writable else bytearray(raw.data)
    flat = torch.frombuffer(buf, dtype=torch.uint8)
    return flat.view(dtype).reshape(raw.shape)
