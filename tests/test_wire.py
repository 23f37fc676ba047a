"""Wire formats: the committed protobuf package, tensor buckets, record adapters."""

from __future__ import annotations

import filecmp
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dapo.v1 import records_pb2, tensor_pb2
from services.common.adapters import decode_group, encode_group
from services.common.tensor_codec import (
    RawTensor,
    TensorWireError,
    WeightAssembler,
    encode_buckets,
    from_torch,
    to_torch,
)
from services.common.types import Group, Sample

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto" / "dapo" / "v1"


def test_generated_package_matches_the_protos(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--out", str(tmp_path)],
        check=True, capture_output=True,
    )  # fmt: skip
    fresh = tmp_path / "dapo" / "v1"
    generated = sorted(p.name for p in PROTO_DIR.iterdir() if "_pb2" in p.name)
    assert generated == sorted(p.name for p in fresh.iterdir() if "_pb2" in p.name)
    assert any(name.endswith(".pyi") for name in generated)
    _, mismatch, errors = filecmp.cmpfiles(PROTO_DIR, fresh, generated, shallow=False)
    assert not mismatch and not errors, (
        f"stale generated files: {mismatch + errors}; run make proto"
    )


@pytest.mark.parametrize("proto", sorted(PROTO_DIR.glob("*.proto")), ids=lambda p: p.name)
def test_protos_follow_the_style_rules(proto: Path) -> None:
    text = proto.read_text()
    assert "package dapo.v1;" in text
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if re.match(r"\s*(message|service|rpc|enum) ", line):
            assert (
                lines[i - 1].strip().startswith("//")
                or "Request {}" in line
                or (re.match(r"\s*message \w+(Request|Response) \{", line))
            ), f"{proto.name}:{i + 1} lacks a comment: {line.strip()}"
    for enum_body in re.findall(r"enum (\w+) \{([^}]*)\}", text):
        name, body = enum_body
        first = re.search(r"(\w+) = 0;", body)
        assert first and first.group(1).endswith("_UNSPECIFIED"), name
    for service in re.findall(r"service (\w+)", text):
        assert service.endswith("Service")


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(33, 17, generator=g),
        "b16": torch.randn(5, 3, generator=g).to(torch.bfloat16),
        "h": torch.randn(7, generator=g).half(),
        "i": torch.arange(11),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(2.5),
    }


@pytest.mark.parametrize("bucket_bytes", [1, 7, 64, 1 << 20])
def test_weights_round_trip_bitwise(bucket_bytes: int) -> None:
    tensors = _tensors()
    buckets = list(encode_buckets([from_torch(n, t) for n, t in tensors.items()], 5, bucket_bytes))
    assert all(len(s.data) <= bucket_bytes for b in buckets for s in b.slices)
    assert [b.index for b in buckets] == list(range(len(buckets))) and buckets[-1].last
    wire = [tensor_pb2.WeightBucket.FromString(b.SerializeToString()) for b in buckets]
    assembler = WeightAssembler()
    for bucket in wire:
        assembler.add(bucket)
    out = {raw.name: to_torch(raw) for raw in assembler.result()}
    assert assembler.version == 5 and out.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert out[name].dtype == tensor.dtype and out[name].shape == tensor.shape
        assert torch.equal(out[name].view(-1).view(torch.uint8), tensor.view(-1).view(torch.uint8))


def _buckets(bucket_bytes: int = 16) -> list[tensor_pb2.WeightBucket]:
    return list(encode_buckets([from_torch(n, t) for n, t in _tensors().items()], 1, bucket_bytes))


def _assemble(buckets: list[tensor_pb2.WeightBucket]) -> list[RawTensor]:
    assembler = WeightAssembler()
    for bucket in buckets:
        assembler.add(bucket)
    return assembler.result()


def test_missing_last_bucket_is_never_applied() -> None:
    with pytest.raises(TensorWireError, match="incomplete"):
        _assemble(_buckets()[:-1])


def test_out_of_order_and_mixed_versions_are_refused() -> None:
    buckets = _buckets()
    with pytest.raises(TensorWireError, match="out of order"):
        _assemble([buckets[1], buckets[0], *buckets[2:]])
    buckets[2].version = 9
    with pytest.raises(TensorWireError, match="version 9"):
        _assemble(buckets)


def test_lying_shapes_and_sizes_are_refused() -> None:
    buckets = _buckets(bucket_bytes=1 << 20)
    buckets[0].slices[0].shape[:] = [3, 3]
    with pytest.raises(TensorWireError, match="total_bytes"):
        _assemble(buckets)
    buckets = _buckets(bucket_bytes=1 << 20)
    buckets[0].slices[0].dtype = 99
    with pytest.raises(TensorWireError, match="unknown dtype"):
        _assemble(buckets)
    with pytest.raises(TensorWireError, match="needs"):
        RawTensor("x", "float32", (2, 2), b"\x00" * 15)


def test_group_round_trips_through_protobuf() -> None:
    group = Group(
        group_id="e0-3", prompt_id="p", prompt="3,7,1=", prompt_token_ids=[1, 2, 3],
        ground_truth="7", run_id="r", epoch=2, admitted_version=4, admitted_at=1.5,
        scored_at=2.5, data_source="synthetic_max3",
        samples=[
            Sample([4, 5], [-0.5, -0.25], "7", "stop", 4, 1.0, True, "7", False, 0.0, ""),
            Sample([6], [-1.0], "9", "length", 3, -1.5, False, "9", True, -0.5, "timeout"),
        ],
    )  # fmt: skip
    assert decode_group(encode_group(group)) == group
    assert group.accuracy == 0.5 and group.min_policy_version == 3


def test_malformed_records_raise_value_error() -> None:
    with pytest.raises(ValueError, match="malformed"):
        decode_group(b"\xff\xff\xff")
    bad = records_pb2.ScoredGroup(samples=[records_pb2.ScoredSample()])
    with pytest.raises(ValueError, match="finish reason"):
        decode_group(bad.SerializeToString())
