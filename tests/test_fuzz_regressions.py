"""One small test per bug the fuzzers found (tests/test_fuzz_*.py), so each stays fixed."""

from __future__ import annotations

import math
import socket
from pathlib import Path

import grpc
import httpx
import pytest
import torch
from fuzzing import raw_call
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dapo.v1 import learner_pb2, learner_pb2_grpc
from learner.weights import WeightServicer, add_weight_service
from reward.http_api import parse_items
from reward.scoring import RequestError
from rollout.metrics import RolloutMetrics
from rollout.torch_engine import TorchEngine
from rollout.weights import WeightUpdater
from services.common.config_loader import ConfigError
from services.common.grpc_server import insecure_channel, start_grpc_server
from services.common.http import create_http_app, serve_http
from services.common.security import TlsConfig
from services.common.server_config import ServerConfig
from services.tools.config import load_config
from services.weight_transport.assembly import Assembling
from services.weight_transport.tensor_codec import encode_buckets
from services.weight_transport.torch_codec import from_torch, to_torch
from services.weight_transport.weight_socket import FRAME, WeightSocketServer


def test_http_connections_have_nagle_off() -> None:
    """uvicorn on a pre-bound socket left Nagle on: every keep-alive reply waited ~40 ms
    for a delayed ACK (1000 fuzz requests took 45 s). Accepted sockets must inherit
    TCP_NODELAY from the listening one."""
    server = serve_http(create_http_app("svc"))
    try:
        with socket.create_connection(("127.0.0.1", server.port)) as client:
            client.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert client.recv(4096).startswith(b"HTTP/1.1 200")
        assert server._sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        with httpx.Client(base_url=server.url) as http:  # keep-alive still answers
            assert [http.get("/healthz").status_code for _ in range(3)] == [200] * 3
    finally:
        server.stop()


def test_json_error_naming_a_key_with_a_newline_stays_on_one_line() -> None:
    """Found by the HTTP fuzzer: `{"\\n": null}` gave a two-line 422 message."""
    try:
        parse_items(b'{"\\n": null}')
    except RequestError as exc:
        message = str(exc)
    assert "\n" not in message and "\\n: Extra inputs are not permitted" in message


def test_json_python_cannot_parse_for_its_structure_is_422_not_500() -> None:
    """Found by the HTTP structure fuzzer: JSON nested past Python's recursion limit
    (RecursionError) and integers of more than 4300 digits (ValueError) escaped
    json.loads as 500 Internal Server Error, and uvicorn then reset the connection."""
    from reward.server import create_server
    from services.tools.config import DapoConfig

    config = DapoConfig.model_validate(
        {
            "reward": {
                "num_workers": 1,
                "default_verifier": "dapo",
                "server": {"grpc_port": 0, "http_port": 0},
            }
        }
    )
    server = create_server(config).start()
    item = b'{"response": "Answer: 1", "ground_truth": "1"}'
    bodies = {
        b"[" * 100_000: "nested too deeply",
        b'{"items": [{"response": ' + b"[" * 5000 + b"]" * 5000 + b"}]}": "nested too deeply",
        b'{"a":' * 5000 + b"1" + b"}" * 5000: "nested too deeply",
        b'{"items": [{"response": "1", "response_length": ' + b"9" * 5000 + b"}]}": "4300 digits",
        b"9" * 4301: "4300 digits",
    }
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{server.http_port}", timeout=30) as http:
            for body, words in bodies.items():
                reply = http.post("/v1/score", content=body)
                assert reply.status_code == 422, (body[:40], reply.text[:200])
                assert words in reply.json()["detail"] and "\n" not in reply.json()["detail"]
                # the same keep-alive connection still serves
                again = http.post("/v1/score", content=b'{"items": [' + item + b"]}")
                assert again.status_code == 200 and again.json()["results"][0]["correct"]
    finally:
        server.stop()


def test_config_error_naming_a_key_with_a_newline_stays_on_one_line() -> None:
    """The config loader shared the same formatting (a YAML key may hold a newline)."""
    try:
        load_config(overrides=["shared.a\nb=1"], env={})
    except ConfigError as exc:
        message = str(exc)
    assert "\n" not in message and "shared.a\\nb" in message


def test_config_file_that_is_not_utf8_is_a_config_error(tmp_path: Path) -> None:
    """Found by the config fuzzer: a non-UTF-8 file raised UnicodeDecodeError."""
    path = tmp_path / "c.yaml"
    path.write_bytes(b"\x80")
    with pytest.raises(ConfigError, match="cannot read .*c.yaml"):
        load_config(path, env={})


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan", "1e400"])
def test_config_refuses_non_finite_numbers(value: str) -> None:
    """Found by the config fuzzer: rollout.drain_timeout_s=1e400 (inf) was accepted, and
    so were an infinite lr, timeout or temperature. (drain_timeout_s went with the Pause
    RPC; weight_poll_s is a float of the same kind.)"""
    for field in ("rollout.weight_poll_s", "learner.optimizer.lr", "reward.timeout_s"):
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            load_config(overrides=[f"{field}={value}"], env={})


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_weight_update_with_non_finite_values_is_refused(tiny_model: Path, value: float) -> None:
    """Found by the UpdateWeights fuzzer: an update holding NaN was applied."""
    engine = TorchEngine(tiny_model, device="cpu")
    updater = WeightUpdater(engine, RolloutMetrics())
    before = {n: t.clone() for n, t in engine.model.state_dict().items()}
    tensors = [from_torch(n, p.detach() + 1.0) for n, p in engine.model.named_parameters()]
    spoiled = to_torch(tensors[-1]).clone()
    spoiled.view(-1)[0] = value
    tensors[-1] = from_torch(tensors[-1].name, spoiled)
    with pytest.raises(ValueError, match="NaN or infinite"):
        updater.apply(Assembling(encode_buckets(tensors, version=1, bucket_bytes=1 << 20)))
    after = engine.model.state_dict()
    assert engine.version == 0 and all(torch.equal(before[n], after[n]) for n in before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_check_finite_finds_one_bad_element_anywhere_in_a_large_tensor(dtype: torch.dtype) -> None:
    """The check reduces the bits per chunk: one NaN (of either sign) or infinity at any
    position, inside a chunk or at its edges, must be found; every finite value (the
    largest of both signs, subnormals, -0.0) passes."""
    from rollout.weights import FINITE_CHUNK, check_finite

    clean = torch.randn(1 << 20 | 13, generator=torch.Generator().manual_seed(0)).to(dtype)
    info = torch.finfo(dtype)
    edges = [info.max, -info.max, info.tiny / 4, -info.tiny / 4, -0.0, 0.0]
    clean[:6] = torch.tensor(edges, dtype=dtype)
    check_finite(from_torch("w", clean))
    check_finite(from_torch("empty", torch.zeros(0, 4, dtype=dtype)))
    # Finite values whose sum overflows (a sum-based check's false alarm) are accepted.
    check_finite(from_torch("huge", torch.full((1 << 12,), info.max / 2, dtype=dtype)))
    per_chunk = FINITE_CHUNK // clean.element_size()
    negative_nan = torch.tensor(-math.nan, dtype=dtype)
    for value in (math.nan, negative_nan, math.inf, -math.inf):
        for at in (0, 31, per_chunk - 1, per_chunk, 1 << 19, clean.numel() - 1):
            bad = clean.clone()
            bad[at] = value
            with pytest.raises(ValueError, match="NaN or infinite"):
                check_finite(from_torch("w", bad))


@pytest.mark.parametrize("keep", [0, 3])
def test_incomplete_weight_update_is_refused(tiny_model: Path, keep: int) -> None:
    """Found by the UpdateWeights fuzzer: an update of no tensors (or only some) was
    applied and moved the version, so samples named a version whose weights were mixed."""
    engine = TorchEngine(tiny_model, device="cpu")
    updater = WeightUpdater(engine, RolloutMetrics())
    before = {n: t.clone() for n, t in engine.model.state_dict().items()}
    tensors = [from_torch(n, p.detach() + 1.0) for n, p in engine.model.named_parameters()]
    with pytest.raises(ValueError, match="is missing"):
        updater.apply(Assembling(encode_buckets(tensors[:keep], version=1, bucket_bytes=1 << 20)))
    after = engine.model.state_dict()
    assert engine.version == 0 and all(torch.equal(before[n], after[n]) for n in before)
    updater.apply(
        Assembling(encode_buckets(tensors, version=1, bucket_bytes=1 << 20))
    )  # every tensor
    after = engine.model.state_dict()  # the parameters may now hold the received memory
    assert engine.version == 1 and not torch.equal(before[tensors[0].name], after[tensors[0].name])


def test_undecodable_grpc_request_is_invalid_argument_not_internal() -> None:
    """Found by the rollout fuzzer: bytes protobuf cannot parse gave INTERNAL
    ("Exception deserializing request!") from every generated servicer."""
    servicer = WeightServicer(bucket_bytes=1024)
    server, port = start_grpc_server(
        ServerConfig(), lambda s: add_weight_service(servicer, s), ["dapo.v1.WeightService"]
    )
    try:
        with insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.RpcError) as err:
                raw_call(channel, "/dapo.v1.WeightService/GetVersion", b"\x01")
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "cannot decode /dapo.v1.WeightService/GetVersion" in err.value.details()
            ok = learner_pb2_grpc.WeightServiceStub(channel).GetVersion(
                learner_pb2.GetVersionRequest(), timeout=10
            )
            assert ok.version == 0  # decodable requests still work
    finally:
        server.stop(0)


@pytest.mark.parametrize("temperature", [1.4e-45, 1e-6, math.inf, math.nan, -1.0])
def test_unusable_temperatures_are_refused(temperature: float) -> None:
    """A subnormal temperature overflowed logits / T and returned NaN log-probs."""
    from rollout.engine import SamplingParams

    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=temperature)
    assert SamplingParams(temperature=0.0).temperature == 0.0  # greedy
    assert SamplingParams(temperature=1e-5).temperature == 1e-5


def test_buckets_announcing_different_tensor_counts_are_refused() -> None:
    from services.weight_transport.assembly import WeightAssembler
    from services.weight_transport.tensor_codec import TensorWireError

    tensors = [from_torch(f"w{i}", torch.arange(8, dtype=torch.float32)) for i in range(2)]
    first, second, *_ = encode_buckets(tensors, 3, 32)
    assembler = WeightAssembler()
    assembler.add(first)
    second.total_tensors += 1
    with pytest.raises(TensorWireError, match="announces"):
        assembler.add(second)


def test_tiny_buckets_are_refused_and_other_sizes_are_not_cached() -> None:
    """bucket_bytes=1 streamed one message per byte; each size asked kept a copy."""
    servicer = WeightServicer(bucket_bytes=64 * 1024)
    servicer.publish(1, [from_torch("w", torch.arange(4096, dtype=torch.float32))])
    server, port = start_grpc_server(
        ServerConfig(), lambda s: add_weight_service(servicer, s), ["dapo.v1.WeightService"]
    )
    try:
        with insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = learner_pb2_grpc.WeightServiceStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                list(stub.FetchWeights(learner_pb2.FetchWeightsRequest(bucket_bytes=1)))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            small = learner_pb2.FetchWeightsRequest(bucket_bytes=4096)
            assert len(list(stub.FetchWeights(small))) >= 4  # 16 KiB in 4 KiB buckets
            # only the default size is kept: one bucket of 16 KiB, not the 4 KiB re-cut too
            assert len(list(servicer._encoded)) == 1
    finally:
        server.stop(0)


def test_health_service_decodes_strictly_lists_and_names_unknown_services() -> None:
    """Found by the health fuzzer: grpc's health servicer answered undecodable bytes with
    INTERNAL, List with UNKNOWN ("Method not implemented!") and an unknown service with
    NOT_FOUND and no message. Watch must still answer by callback: 8 open watches on a
    server with 2 threads leave room for Check."""
    server, port = start_grpc_server(ServerConfig(), lambda s: None, ["dapo.v1.X"], max_workers=2)
    health = "/grpc.health.v1.Health"
    try:
        with insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.RpcError) as err:
                raw_call(channel, f"{health}/Check", b"\x01")
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "cannot decode" in err.value.details()
            stub = health_pb2_grpc.HealthStub(channel)
            listed = stub.List(health_pb2.HealthListRequest(), timeout=10)
            assert sorted(listed.statuses) == ["", "dapo.v1.X"]
            with pytest.raises(grpc.RpcError) as err:
                stub.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=10)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            assert "unknown service 'nope'" in err.value.details()
            watches = [stub.Watch(health_pb2.HealthCheckRequest(), timeout=10) for _ in range(8)]
            assert all(next(w).status == health_pb2.HealthCheckResponse.SERVING for w in watches)
            assert stub.Check(health_pb2.HealthCheckRequest(), timeout=10).status == 1
            for watch in watches:
                watch.cancel()
    finally:
        server.stop(0)


def test_weight_socket_input_after_the_ticket_does_not_cut_the_stream() -> None:
    """The weight socket closed with the bytes a client sent after its ticket unread, so
    the kernel sent RST and dropped the frames still queued (found by the raw socket
    fuzzer; 8 MiB of 32 lost on loopback). It now half-closes and waits for the client."""
    server = WeightSocketServer("127.0.0.1", 0, TlsConfig()).start()
    frames = [bytes([i]) * (4 << 20) for i in range(8)]
    expected = b"".join(FRAME.pack(len(f)) + f for f in frames) + FRAME.pack(0)
    frames_as_parts = [[f] for f in frames]
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as client:
            client.sendall(server.issue(frames_as_parts) + b"junk")
            client.shutdown(socket.SHUT_WR)
            got = bytearray()
            while chunk := client.recv(1 << 20):  # a reset raises here
                got += chunk
        assert got == expected
    finally:
        server.stop()
