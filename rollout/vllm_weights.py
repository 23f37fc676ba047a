"""The bytes of a weight swap into vLLM's workers: buckets of (name, dtype, shape, raw
bytes), which vLLM's `collective_rpc` carries as msgpack `bin` fields (it would not carry
tensors: its generic decoder does not rebuild them). Torch only, so it imports without
vLLM."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from services.weight_transport.buckets import runs_by_size

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def encode_bucket(
    updates: Sequence[tuple[str, torch.Tensor]],
) -> list[tuple[str, str, list[int], memoryview]]:
    """(name, dtype, shape, raw bytes) per tensor: what vLLM's RPC carries (msgpack bin)."""
    bucket = []
    for name, tensor in updates:
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        raw = flat.view(torch.uint8).numpy().data if flat.numel() else memoryview(b"")
        bucket.append((name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), raw))
    return bucket


def decode_bucket(bucket: Iterable[Sequence[Any]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors viewing the received bytes (no copy; the model's loader copies them in)."""
    for name, dtype_name, shape, raw in bucket:
        dtype = DTYPES[dtype_name]
        if not raw:
            yield name, torch.empty(shape, dtype=dtype)
            continue
        with warnings.catch_warnings():  # read-only bytes: the loader only reads them
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(raw, dtype=torch.uint8)
        yield name, flat.view(dtype).reshape(shape)


def buckets_of(
    updates: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive runs of tensors of at most `bucket_bytes` (a larger tensor goes alone)."""
    return runs_by_size(updates, lambda t: t.numel() * t.element_size(), bucket_bytes)
