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
from services.common.types import Group, Sample
from services.weight_transport.assembly import WeightAssembler
from services.weight_transport.tensor_codec import (
    RawTensor,
    TensorWireError,
    encode_bucket_bytes,
    encode_bucket_parts,
    encode_buckets,
    parse_bucket,
)
from services.weight_transport.torch_codec import from_torch, to_torch, torch_view

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto" / "dapo" / "v1"


def test_generated_package_matches_the_protos(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
    )
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


@pytest.mark.parametrize("bucket_bytes", [1, 7, 64, 1 << 20])
def test_zero_copy_path_is_the_protobuf_wire_format_and_bitwise(bucket_bytes: int) -> None:
    tensors = _tensors()
    raws = [torch_view(n, t) for n, t in tensors.items()]
    spliced = list(encode_bucket_bytes(raws, 5, bucket_bytes))
    assert spliced == [b.SerializeToString() for b in encode_buckets(raws, 5, bucket_bytes)]
    assembler = WeightAssembler()
    for message in spliced:
        assembler.add(parse_bucket(message))
    out = {raw.name: to_torch(raw) for raw in assembler.result()}
    for name, tensor in tensors.items():
        assert out[name].dtype == tensor.dtype and out[name].shape == tensor.shape
        assert torch.equal(out[name].view(-1).view(torch.uint8), tensor.view(-1).view(torch.uint8))
    out["w"].fill_(0)  # the received tensors own their memory: the sender's are untouched
    assert not torch.equal(out["w"], tensors["w"])


@pytest.mark.parametrize("bucket_bytes", [7, 1 << 20])
def test_bucket_parts_join_to_the_wire_format_and_view_the_tensors(bucket_bytes: int) -> None:
    """What the weight socket sends scatter/gather: each bucket's parts join to exactly
    its serialized message, and the tensor bytes in them are views, not copies."""
    tensors = _tensors()
    raws = [torch_view(n, t) for n, t in tensors.items()]
    frames = list(encode_bucket_parts(raws, 5, bucket_bytes))
    joined = [b"".join(parts) for parts in frames]
    assert joined == [b.SerializeToString() for b in encode_buckets(raws, 5, bucket_bytes)]
    tensors["w"].add_(1.0)  # the parts see the change: they view the tensor
    assert [b"".join(parts) for parts in frames] != joined


def test_malformed_serialized_buckets_are_refused() -> None:
    good = next(encode_bucket_bytes([from_torch("w", torch.ones(4))], 1, 1 << 20))
    for bad, why in [
        (good[:-3], "truncated"),
        (good + b"\xff", "varint"),
        (good + b"\x0b", "wire type 3"),  # a group: never in our messages
        (b"\x08" + b"\x80" * 11, "varint"),  # a varint longer than 64 bits
    ]:
        with pytest.raises(TensorWireError, match=why):
            parse_bucket(bad)
    liar = tensor_pb2.WeightBucket(last=True, total_tensors=1)
    liar.slices.add(name="w", dtype=tensor_pb2.DTYPE_UINT8, shape=[1 << 40], total_bytes=1 << 40)
    with pytest.raises(TensorWireError, match="exceeds"):
        WeightAssembler().add(parse_bucket(liar.SerializeToString()))


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
        group_id="e0-3",
        prompt_id="p",
        prompt="3,7,1=",
        prompt_token_ids=[1, 2, 3],
        ground_truth="7",
        run_id="r",
        epoch=2,
        admitted_version=4,
        admitted_at=1.5,
        scored_at=2.5,
        data_source="synthetic_max3",
        samples=[
            Sample([4, 5], [-0.5, -0.25], "7", "stop", 4, 1.0, True, "7", False, 0.0, ""),
            Sample([6], [-1.0], "9", "length", 3, -1.5, False, "9", True, -0.5, "timeout"),
        ],
    )
    assert decode_group(encode_group(group)) == group
    assert group.accuracy == 0.5 and group.min_policy_version == 3


def test_malformed_records_raise_value_error() -> None:
    with pytest.raises(ValueError, match="malformed"):
        decode_group(b"\xff\xff\xff")
    bad = records_pb2.ScoredGroup(samples=[records_pb2.ScoredSample()])
    with pytest.raises(ValueError, match="finish reason"):
        decode_group(bad.SerializeToString())


def test_published_version_is_a_snapshot_served_bitwise_over_grpc() -> None:
    from dapo.v1 import learner_pb2
    from learner.weights import WeightServicer, add_weight_service, live_views
    from rollout.weights import WeightStub
    from services.common.grpc_server import insecure_channel, start_grpc_server
    from services.common.server_config import ServerConfig

    weights = _tensors()
    expected = {n: t.clone() for n, t in weights.items()}
    servicer = WeightServicer(bucket_bytes=64)
    servicer.publish(7, live_views(weights.items()))
    weights["w"].add_(1.0)  # the next step trains in place: the published version holds
    server, port = start_grpc_server(
        ServerConfig(), lambda s: add_weight_service(servicer, s), ["dapo.v1.WeightService"]
    )
    try:
        with insecure_channel(f"127.0.0.1:{port}") as channel:
            assembler = WeightAssembler()
            request = learner_pb2.FetchWeightsRequest(version=7)
            for bucket in WeightStub(channel).FetchWeights(request, timeout=30):
                assembler.add(bucket)
    finally:
        server.stop(0)
    assert assembler.version == 7 and assembler.next_index > 5
    out = {raw.name: to_torch(raw) for raw in assembler.result()}
    assert out.keys() == expected.keys()
    for name, tensor in expected.items():
        assert out[name].dtype == tensor.dtype and torch.equal(out[name], tensor), name


def test_malloc_tuning_applies_on_glibc() -> None:
    code = "from services.common.malloc import keep_freed_memory as k; print(k())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


def test_memory_freed_by_one_thread_is_reused_by_the_next_without_page_faults() -> None:
    """With one arena, a 200 MB buffer freed by a thread (a version's received tensors)
    comes back to the next thread mapped: filling it again costs no page faults."""
    code = """
import resource, threading, numpy
from services.common.malloc import keep_freed_memory
assert keep_freed_memory()
faults = []
def version():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    numpy.empty(200_000_000, numpy.uint8).fill(1)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
for _ in range(3):
    thread = threading.Thread(target=version)
    thread.start()
    thread.join()
print(*faults)
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    first, *later = map(int, out.stdout.split())
    # fresh: 200 MB of pages (about 100 faults with numpy's huge pages, 49k without);
    # without one arena every thread's buffer is a fresh mmap and each costs as many
    assert first > 50 and all(n * 10 < first for n in later), out.stdout


def test_a_freed_version_at_the_top_of_the_heap_is_kept_for_the_next() -> None:
    """A rollout server's swap: version N arrives while N - 1 is held, then N - 1 goes.
    Every other version the freed one lies at the top of the heap, larger than the
    threshold (here 64 MiB, a model of 100 MB): it must not go back to the kernel."""
    code = """
import resource, numpy
from services.common.malloc import keep_freed_memory
assert keep_freed_memory(64 << 20)
def version():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    tensors = [numpy.empty(25_000_000, numpy.uint8) for _ in range(4)]
    for t in tensors:
        t.fill(1)
    return tensors, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
held, faults = version()
counts = [faults]
for _ in range(5):
    new, faults = version()
    held = new  # the older version is freed only once the new one is complete
    counts.append(faults)
print(*counts)
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    first, second, *later = map(int, out.stdout.split())
    assert first > 20 and second > 20  # two versions live at once: both fresh
    assert all(n * 10 < first for n in later), out.stdout
