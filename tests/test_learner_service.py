"""The learner service with DeepSpeed on CPU: commit/ack protocol, checkpoint → crash →
resume, stop, the final export, and weights reaching a rollout engine bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import redis
import torch
from learner_fixtures import TORCH_FP32_STEP, fill_train, learner_config, make_groups

from dapo.v1 import learner_pb2, learner_pb2_grpc
from learner.server import Learner
from learner.weights import add_weight_service
from services.common.adapters import decode_group, encode_group
from services.common.grpc_server import start_grpc_server
from services.common.keys import RunKeys
from services.common.server_config import ServerConfig
from services.tools.config import DapoConfig
from services.weight_transport.assembly import WeightAssembler
from services.weight_transport.torch_codec import to_torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")
BATCH = 2  # groups per step


def _config(model: Path, run: str, ckpt: Path | None, **learner) -> DapoConfig:
    sets = {
        **TORCH_FP32_STEP,
        "learner.engine": "deepspeed",  # the same step on DeepSpeed ZeRO-0
        "learner.deepspeed.zero_stage": 0,
        "learner.optimizer.warmup_steps": 2,
        "shared.train_batch_groups": BATCH,
        "learner.checkpoint.every": 2,
        "learner.total_steps": 4,
        **{f"learner.{k}": v for k, v in learner.items()},
    }
    if ckpt is not None:
        sets["learner.checkpoint.dir"] = str(ckpt)
    return learner_config(model, run, sets)


def _counts(client: redis.Redis, run: str) -> tuple[int, int, int]:
    """(trained, pending in the consumer group, version)."""
    keys = RunKeys(run)
    trained = int(client.hget(keys.ledger, "trained") or 0)
    pending = int(client.xpending(keys.train, "learner")["pending"])
    return trained, pending, int(client.get(keys.version) or 0)


def _state(learner: Learner) -> dict[str, torch.Tensor]:
    out = {f"param:{n}": p.detach().clone() for n, p in learner.policy.module.named_parameters()}
    for k, st in learner.policy.optimizer.state_dict()["state"].items():
        out.update({f"opt:{k}:{name}": torch.as_tensor(v).clone() for name, v in st.items()})
    out["lr"] = torch.tensor(learner.policy.lr())
    return out


def _steps(learner: Learner, n: int) -> None:
    stop = threading.Event()
    for _ in range(n):
        assert learner.fill_batch(stop)
        learner.train_once()
    learner.publisher.wait()  # publication runs in the background


def test_checkpoint_crash_resume_equals_uninterrupted_run(
    tiny_model: Path, redis_client: redis.Redis, tmp_path: Path
) -> None:
    # Uninterrupted: 4 steps, checkpoints at 2 and 4, then the final export.
    fill_train(redis_client, "a", BATCH * 4, seed=11)
    ref = Learner(_config(tiny_model, "a", tmp_path / "a"), redis_client)
    ref.run(threading.Event())
    assert _counts(redis_client, "a") == (4 * BATCH, 0, 4)
    want = _state(ref)

    # Interrupted: the checkpoint at step 2 is written but the learner dies before its acks,
    # then it trains step 3 and dies again (nothing acked at all).
    ids = fill_train(redis_client, "b", BATCH * 4, seed=11)
    config = _config(tiny_model, "b", tmp_path / "b")
    first = Learner(config, redis_client)
    first.stream.ack_trained = lambda ids: None  # the crash window between checkpoint and XACK
    _steps(first, 3)
    first.trainer.writer.wait()  # step 2's checkpoint, written in the background...
    first.checkpoints.poll()  # ... collected: `latest` moves, the acks are lost
    assert (tmp_path / "b" / "latest").read_text() == "step2"
    assert _counts(redis_client, "b") == (0, 3 * BATCH, 3)
    del first

    resumed = Learner(
        _config(tiny_model, "b", tmp_path / "b", **{"checkpoint.resume": True}), redis_client
    )
    assert (resumed.step, resumed.cursor) == (2, ids[2 * BATCH - 1])
    assert resumed.version == 4  # rollout servers saw 3: never go backwards
    resumed.run(threading.Event())
    got = _state(resumed)
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), name
    # Every entry counted trained exactly once; steps 3 and 4 retrained after the crash.
    assert _counts(redis_client, "b") == (4 * BATCH, 0, 6)
    assert redis_client.get(RunKeys("b").done) is not None


def test_final_export_loads_in_transformers(
    tiny_model: Path, redis_client: redis.Redis, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    fill_train(redis_client, "x", BATCH * 2, seed=11)
    learner = Learner(
        _config(tiny_model, "x", tmp_path / "ck", **{"total_steps": 2, "deepspeed.zero_stage": 3}),
        redis_client,
    )
    learner.run(threading.Event())
    final = tmp_path / "ck" / "final"
    model = AutoModelForCausalLM.from_pretrained(final)
    assert AutoTokenizer.from_pretrained(final).pad_token_id is not None
    trained = dict(learner.policy.named_weights())  # the tied head once, as the embedding
    trained["lm_head.weight"] = trained["model.embed_tokens.weight"]
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, trained[name]), name


def test_stop_checkpoints_and_acks_what_was_trained(
    tiny_model: Path, redis_client: redis.Redis, tmp_path: Path
) -> None:
    fill_train(redis_client, "s", BATCH * 3, seed=11)
    learner = Learner(
        _config(tiny_model, "s", tmp_path / "s", **{"total_steps": 50, "checkpoint.every": 50}),
        redis_client,
    )
    stop = threading.Event()
    thread = threading.Thread(target=learner.run, args=(stop,))
    thread.start()
    deadline = time.monotonic() + 120
    while learner.step < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _counts(redis_client, "s") == (0, 3 * BATCH, 3)  # trained, not yet checkpointed
    stop.set()  # what SIGTERM does (services.common.lifecycle)
    thread.join(60)
    assert (tmp_path / "s" / "latest").read_text() == "step3"
    assert _counts(redis_client, "s") == (3 * BATCH, 0, 3)
    assert redis_client.get(RunKeys("s").done) is None


def test_without_checkpoints_each_step_acks_its_entries(
    tiny_model: Path, redis_client: redis.Redis
) -> None:
    fill_train(redis_client, "n", BATCH * 1, seed=11)
    learner = Learner(_config(tiny_model, "n", None, engine="torch"), redis_client)
    _steps(learner, 1)
    assert _counts(redis_client, "n") == (BATCH, 0, 1)


def test_groups_between_the_bounds_train_and_past_the_hard_bound_drop(
    tiny_model: Path, redis_client: redis.Redis
) -> None:
    """Soft bound 1, hard bound 2, learner at version 4: lag 2 trains (counted), lag 3 drops."""
    cfg = _config(tiny_model, "h", None, engine="torch")
    shared = cfg.shared.model_copy(update={"max_staleness": 1, "max_staleness_hard": 2})
    cfg = cfg.model_copy(update={"shared": shared})
    redis_client.set(RunKeys("h").version, 3)  # the learner publishes its weights as 4
    groups = make_groups(n_groups=5, seed=11)
    for group, version in zip(groups, [4, 2, 1, 4, 3], strict=True):
        for sample in group.samples:
            sample.policy_version = version
    for g in groups:
        redis_client.xadd(RunKeys("h").train, {"group": encode_group(g)})
    learner = Learner(cfg, redis_client)
    assert learner.version == 4
    _steps(learner, 2)  # step 1: lags 0 and 2; step 2 (version 5): lag 4 dropped, 1 and 2
    ledger = {k.decode(): int(v) for k, v in redis_client.hgetall(RunKeys("h").ledger).items()}
    assert ledger["trained"] == 4 and ledger["dropped:stale"] == 1
    records = [json.loads(f[b"json"]) for _, f in redis_client.xrange(RunKeys("h").metrics)]
    assert [r["beyond_soft"] for r in records] == [1, 1]
    assert [r["staleness"] for r in records] == [2, 2]
    assert [r["policy_lag_max"] for r in records] == [2, 2]
    assert records[0]["is_weight_mean"] != 1.0  # the correction is on (engine log-probs differ)
    # A group held across a step that pushed it past the hard bound is dropped before training.
    held = make_groups(n_groups=1, seed=12)[0]
    for sample in held.samples:
        sample.policy_version = 4  # lag 2 now (version 6); 3 after the next step
    redis_client.xadd(RunKeys("h").train, {"group": encode_group(held)})
    (entry,) = learner.stream.consumer.read(1, block_ms=100)
    learner.stream.held.append((entry, decode_group(entry.fields["group"])))
    learner.version += 1
    learner.stream.recheck_held(learner.version)
    assert not learner.stream.held
    assert int(redis_client.hget(RunKeys("h").ledger, "dropped:stale") or 0) == 2


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_published_weights_reach_a_rollout_engine_bitwise(
    tiny_model: Path, redis_client: redis.Redis, zero_stage: int
) -> None:
    from rollout.torch_engine import TorchEngine

    fill_train(redis_client, "w", BATCH * 1, seed=11)
    learner = Learner(
        _config(tiny_model, "w", None, **{"deepspeed.zero_stage": zero_stage}), redis_client
    )
    _steps(learner, 1)
    server, port = start_grpc_server(
        ServerConfig(),
        lambda s: add_weight_service(learner.weights, s),
        ["dapo.v1.WeightService"],
    )
    engine = TorchEngine(tiny_model, device="cpu")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = learner_pb2_grpc.WeightServiceStub(channel)
            request = learner_pb2.FetchWeightsRequest(version=0, bucket_bytes=4096)
            assembler = WeightAssembler()
            for bucket in stub.FetchWeights(request):
                assembler.add(bucket)
            assert assembler.version == 1 and assembler.next_index > 10  # many buckets
            engine.load_weights(((t.name, to_torch(t)) for t in assembler.result()), 1)
    finally:
        server.stop(0)
    served = engine.model.state_dict()
    published = dict(learner.policy.named_weights())
    assert set(served) - set(published) == {"lm_head.weight"}  # tied: sent once, as the
    # embedding, and the engine's head is that tensor
    assert served["lm_head.weight"].data_ptr() == served["model.embed_tokens.weight"].data_ptr()
    initial = TorchEngine(tiny_model, device="cpu").model.state_dict()
    assert any(not torch.equal(initial[n], t) for n, t in published.items())  # it trained
    for name, tensor in published.items():
        assert served[name].dtype == tensor.dtype and torch.equal(served[name], tensor), name


@pytest.mark.slow
def start_rank(cmd: list[str], rank: int, world: int, port: str) -> subprocess.Popen:
    """One rank of a torchrun-like launch on CPU (gloo), output captured."""
    env = dict(
        os.environ,
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=port,
        DS_ACCELERATOR="cpu",
    )
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)


def test_two_rank_zero3_service_trains_and_serves_gathered_weights(
    tiny_model: Path, redis_server, redis_client: redis.Redis
) -> None:
    """`dapo learner` as 2 data-parallel ranks (gloo, ZeRO-3) for 3 steps, end to end."""
    from rollout.torch_engine import TorchEngine
    from rollout.weights import WeightStub
    from services.common.grpc_server import insecure_channel
    from services.common.net import free_port
    from services.common.registry import discover

    run, keys, port = "dp2", RunKeys("dp2"), str(free_port())
    fill_train(redis_client, run, BATCH * 3, seed=11)
    sets = {
        "shared.run_name": run,
        "shared.model_path": str(tiny_model),
        "shared.max_staleness": 100,
        "shared.max_response_length": 16,
        "shared.overlong_buffer_length": 0,
        "learner.engine": "deepspeed",
        "learner.deepspeed.zero_stage": 3,
        "learner.dtype": "float32",
        "learner.optimizer.lr": 1e-2,
        "shared.train_batch_groups": BATCH,
        "learner.batching.mini_batch_responses": 4,
        "learner.batching.micro_batch_tokens": 64,
        "learner.total_steps": 3,
        "learner.linger_s": 120,
    }
    cmd = [
        sys.executable,
        "-m",
        "services.tools.cli",
        "learner",
        "--redis-url",
        redis_server.url,
        "--grpc-port",
        "0",
        "--http-port",
        "0",
    ]
    cmd += [arg for k, v in sets.items() for arg in ("--set", f"{k}={v}")]
    procs = [start_rank(cmd, rank, world=2, port=port) for rank in range(2)]
    try:
        deadline = time.monotonic() + 240
        while redis_client.get(keys.done) is None:
            # a crash fails at once; the follower may finish (exit 0) before rank 0 sets done
            assert all(p.poll() in (None, 0) for p in procs), _output(procs)
            assert time.monotonic() < deadline, _output(procs)
            time.sleep(0.2)
        assert _counts(redis_client, run) == (3 * BATCH, 0, 3)
        (entry,) = discover(redis_client, keys, "learner")
        with insecure_channel(entry["address"], 64 << 20) as channel:
            assembler = WeightAssembler()
            stub = WeightStub(channel)
            for bucket in stub.FetchWeights(learner_pb2.FetchWeightsRequest(), timeout=60):
                assembler.add(bucket)
        served = {t.name: to_torch(t) for t in assembler.result()}
        assert assembler.version == 3
        initial = TorchEngine(tiny_model, device="cpu").model.state_dict()
        # every ZeRO-3 partition was gathered; the tied head is the embedding, sent once
        assert set(initial) - set(served) == {"lm_head.weight"} and set(served) <= set(initial)
        assert all(served[n].shape == initial[n].shape for n in served)
        assert any(not torch.equal(t, initial[n]) for n, t in served.items())  # it trained
    finally:
        procs[0].terminate()  # ends the linger; rank 1 already got the stop
        outputs = [p.communicate(timeout=60)[0].decode() for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-2000:] for o in outputs)


def _output(procs: list) -> str:
    """The tail of every rank's output, for an assertion message (stops them first)."""
    for p in procs:
        p.kill()
    return "\n".join(p.communicate()[0].decode()[-2000:] for p in procs)
