"""The real services behind TLS, the bearer token and small size limits: the reward
service (gRPC and HTTP) and a rollout server's control RPC.

Certificates come from a throw-away CA (tests/pki.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pki import Pki, client_tls, make_pki, server_tls

from services.common.grpc_server import channel, insecure_channel
from services.common.security import AuthConfig, SecurityConfig
from services.tools.config import DapoConfig

TOKEN = "s3cret-token"


def healthy(chan: grpc.Channel) -> bool:
    reply = health_pb2_grpc.HealthStub(chan).Check(health_pb2.HealthCheckRequest(), timeout=10)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def code_of(call: Any) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code()


SCORE = "/dapo.v1.RewardService/Score"


@pytest.fixture(scope="module")
def secured_reward(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Pki]]:
    """The reward service with TLS, a token on everything, and small size limits."""
    from reward.server import create_server

    pki = make_pki(tmp_path_factory.mktemp("reward-pki"))
    config = DapoConfig.model_validate(
        {
            "reward": {
                "num_workers": 1,
                "max_request_bytes": 8 * 1024,
                "server": {"grpc_port": 0, "http_port": 0},
            },
            "shared": {"rpc": {"max_message_bytes": 64 * 1024}},
            "security": {
                "tls": server_tls(pki).model_dump(),
                "auth": {"token": TOKEN, "scope": "all"},
            },
        }
    )
    server = create_server(config).start()
    assert server.scorer.pool.wait_ready(60)
    yield server, pki
    server.stop()


def score_request() -> Any:
    from dapo.v1 import reward_pb2

    item = reward_pb2.ScoreItem(
        response="42", ground_truth="42", verifier=reward_pb2.VERIFIER_FIRST_INTEGER
    )
    return reward_pb2.ScoreRequest(items=[item])


def test_reward_grpc_over_tls_with_token_and_size_limit(secured_reward: tuple[Any, Pki]) -> None:
    from dapo.v1 import reward_pb2_grpc

    server, pki = secured_reward
    address = f"127.0.0.1:{server.grpc_port}"
    tls_only = SecurityConfig(tls=client_tls(pki))
    with channel(address, tls_only) as anonymous:
        stub = reward_pb2_grpc.RewardServiceStub(anonymous)
        assert code_of(lambda: stub.Score(score_request(), timeout=30)).name == "UNAUTHENTICATED"
    full = SecurityConfig(tls=client_tls(pki), auth=AuthConfig(token=TOKEN))
    with channel(address, full) as chan:
        stub = reward_pb2_grpc.RewardServiceStub(chan)
        assert stub.Score(score_request(), timeout=30).results[0].correct
        oversize = chan.unary_unary(SCORE)
        too_big = code_of(lambda: oversize(b"\x0a" + b"\x00" * 100_000, timeout=30))
        assert too_big == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert healthy(chan) and stub.Score(score_request(), timeout=30).results[0].correct


def test_reward_http_token_and_body_limit(secured_reward: tuple[Any, Pki]) -> None:
    server, _ = secured_reward
    body = {"items": [{"response": "7", "ground_truth": "7", "verifier": "first_integer"}]}
    good = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=f"http://127.0.0.1:{server.http_port}", timeout=30) as client:
        assert client.post("/v1/score", json=body).status_code == 401  # scope "all"
        assert client.get("/status").status_code == 401
        reply = client.post("/v1/score", json=body, headers=good)
        assert reply.status_code == 200 and reply.json()["results"][0]["correct"]
        huge = {"items": [{"response": "x" * 20_000, "ground_truth": "1"}]}
        assert client.post("/v1/score", json=huge, headers=good).status_code == 413
        assert client.get("/healthz").status_code == 200
        assert client.post("/v1/score", json=body, headers=good).status_code == 200


def test_rollout_get_status_needs_the_token(tiny_model: Path) -> None:
    from dapo.v1 import rollout_pb2, rollout_pb2_grpc
    from rollout.server import RolloutServer
    from rollout.torch_engine import TorchEngine

    config = DapoConfig.model_validate(
        {
            "shared": {
                "max_prompt_length": 12,
                "max_response_length": 4,
                "overlong_buffer_length": 0,
                "group_size": 2,
            },
            "rollout": {"server": {"grpc_port": 0, "http_port": 0}},
            "security": {"auth": {"token": TOKEN}},
        }
    )
    server = RolloutServer(config, None, TorchEngine(tiny_model, device="cpu", max_batch_size=4))
    server.start()
    address = f"127.0.0.1:{server.grpc_port}"
    generate = rollout_pb2.GenerateRequest(
        request_id="r",
        prompt_token_ids=[3, 5],
        n=1,
        sampling=rollout_pb2.SamplingParams(temperature=1.0, max_tokens=2, seed=1),
    )
    try:
        with insecure_channel(address) as anonymous:
            stub = rollout_pb2_grpc.RolloutServiceStub(anonymous)
            status = rollout_pb2.GetStatusRequest()
            assert code_of(lambda: stub.GetStatus(status, timeout=10)).name == "UNAUTHENTICATED"
            assert len(stub.GenerateGroup(generate, timeout=60).completions) == 1  # open
        with channel(address, config.security) as ours:
            stub = rollout_pb2_grpc.RolloutServiceStub(ours)
            reply = stub.GetStatus(status, timeout=10)
            assert (reply.ready, reply.version, reply.engine) == (True, 0, "torch")
    finally:
        server.stop()
