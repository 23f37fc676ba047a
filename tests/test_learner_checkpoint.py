"""Background checkpoints of the DeepSpeed learner (CPU; ZeRO-2, and ZeRO-3 where the
partitioned state matters): the steps after a checkpoint train while it is written, the
checkpoint holds its own step's state (not the later steps'), `latest` moves only once it
is whole, a failed write leaves `latest` (and the acks) on the previous checkpoint, which
a restarted learner resumes from, and a stop waits for the write in flight."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import redis
import torch
from learner_fixtures import TORCH_FP32_STEP, fill_train, learner_config

from learner.server import Learner
from services.common.errors import DapoError
from services.common.keys import RunKeys
from services.tools.config import DapoConfig

os.environ.setdefault("DS_ACCELERATOR", "cpu")
BATCH = 2


def _config(model: Path, run: str, ckpt: Path, stage: int = 2, **learner: object) -> DapoConfig:
    sets = {
        **TORCH_FP32_STEP,
        "learner.engine": "deepspeed",
        "learner.deepspeed.zero_stage": stage,
        "shared.train_batch_groups": BATCH,
        "learner.checkpoint.every": 2,
        "learner.checkpoint.dir": str(ckpt),
        "learner.checkpoint.async_write": "true",
        "learner.total_steps": 50,
        **{f"learner.{k}": v for k, v in learner.items()},
    }
    return learner_config(model, run, sets)


def _steps(learner: Learner, n: int) -> None:
    for _ in range(n):
        assert learner.fill_batch(threading.Event())
        learner.train_once()


def _acked(client: redis.Redis, run: str) -> tuple[int, int]:
    """(trained, pending) of the run's train stream."""
    keys = RunKeys(run)
    pending = int(client.xpending(keys.train, "learner")["pending"])
    return int(client.hget(keys.ledger, "trained") or 0), pending


def slowed_torch_save(monkeypatch: pytest.MonkeyPatch, release: threading.Event) -> None:
    """torch.save that waits for `release` first: a write slower than the steps."""
    real = torch.save

    def slow(obj: object, f: object, *args: object, **kwargs: object) -> None:
        release.wait(60)
        real(obj, f, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch, "save", slow)


def test_steps_train_while_a_checkpoint_is_written_and_latest_waits_for_it(
    tiny_model: Path, redis_client: redis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fill_train(redis_client, "w", BATCH * 4, seed=11)
    learner = Learner(_config(tiny_model, "w", tmp_path / "ck"), redis_client)
    release = threading.Event()
    slowed_torch_save(monkeypatch, release)
    _steps(learner, 3)  # step 2's checkpoint is still being written: step 3 trained
    assert learner.trainer.writer.tag == "step2" and learner.trainer.writer.busy
    assert not (tmp_path / "ck" / "latest").exists()
    assert _acked(redis_client, "w") == (0, 3 * BATCH)  # nothing acked before it is whole
    assert learner.status()["unacked"] == 3 * BATCH
    release.set()
    learner.trainer.writer.wait()
    _steps(learner, 1)  # step 4: step 2's write collected, step 4's started
    learner.checkpoint(final=True)  # a stop: waits for the write in flight
    assert (tmp_path / "ck" / "latest").read_text() == "step4"
    assert _acked(redis_client, "w") == (4 * BATCH, 0)
    shards = sorted(p.name for p in (tmp_path / "ck" / "step2").iterdir())
    assert any("optim_states" in s for s in shards) and not any(".tmp" in s for s in shards)


def _weights(learner: Learner) -> dict[str, torch.Tensor]:
    return {name: t.detach().cpu().clone() for name, t in learner.policy.named_weights()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("stage", [2, 3])
def test_a_background_checkpoint_holds_its_own_step_and_resumes_bitwise(
    tiny_model: Path,
    redis_client: redis.Redis,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    stage: int,
) -> None:
    """Step 3 trains while step 2's checkpoint is written (slowed): the checkpoint holds
    step 2's weights and optimizer state, so a learner resumed from it has step 2's
    weights bitwise and trains step 3 again to step 3's weights bitwise."""
    run = f"z{stage}"
    fill_train(redis_client, run, BATCH * 4, seed=5)
    learner = Learner(_config(tiny_model, run, tmp_path / "ck", stage), redis_client)
    release = threading.Event()
    slowed_torch_save(monkeypatch, release)
    _steps(learner, 2)
    at_step2 = _weights(learner)
    _steps(learner, 1)  # trains (changing the state in place) while step 2 is written
    at_step3 = _weights(learner)
    assert learner.trainer.writer.tag == "step2" and not _same(at_step2, at_step3)
    release.set()
    learner.trainer.writer.wait()
    learner.checkpoints.poll()  # collected: `latest` names step 2
    assert (tmp_path / "ck" / "latest").read_text() == "step2"
    del learner

    config = _config(tiny_model, run, tmp_path / "ck", stage, **{"checkpoint.resume": True})
    resumed = Learner(config, redis_client)
    assert resumed.step == 2 and _same(_weights(resumed), at_step2)
    _steps(resumed, 1)
    assert _same(_weights(resumed), at_step3)


def test_a_failed_write_leaves_latest_on_the_last_whole_checkpoint(
    tiny_model: Path, redis_client: redis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = fill_train(redis_client, "f", BATCH * 6, seed=11)
    config = _config(tiny_model, "f", tmp_path / "ck")
    learner = Learner(config, redis_client)
    _steps(learner, 2)
    learner.trainer.writer.wait()
    _steps(learner, 1)  # step 3 collects step 2's write
    assert (tmp_path / "ck" / "latest").read_text() == "step2"

    def disk_full(obj: object, f: object, *args: object, **kwargs: object) -> None:
        f.write(b"part of a shard")  # type: ignore[attr-defined]  # (an open file)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    _steps(learner, 1)  # step 4's write starts, and fails
    learner.trainer.writer.wait()
    with pytest.raises(DapoError, match="checkpoint step4 was not written: .*No space left"):
        _steps(learner, 1)
    assert (tmp_path / "ck" / "latest").read_text() == "step2"
    assert _acked(redis_client, "f") == (2 * BATCH, 3 * BATCH)  # step 2's only
    monkeypatch.undo()
    del learner

    resumed = Learner(
        _config(tiny_model, "f", tmp_path / "ck", **{"checkpoint.resume": True}), redis_client
    )
    assert (resumed.step, resumed.cursor) == (2, ids[2 * BATCH - 1])
    _steps(resumed, 2)  # steps 3 and 4 again, from the entries still pending
    resumed.checkpoint(final=True)
    assert (tmp_path / "ck" / "latest").read_text() == "step4"
    assert _acked(redis_client, "f") == (4 * BATCH, BATCH)  # the failed step's 5th batch


def test_a_stop_that_cannot_fit_its_budget_skips_its_checkpoint(
    tiny_model: Path, redis_client: redis.Redis, tmp_path: Path
) -> None:
    fill_train(redis_client, "b", BATCH * 3, seed=11)
    learner = Learner(
        _config(tiny_model, "b", tmp_path / "ck", **{"launch.shutdown_timeout_s": 1}),
        redis_client,
    )
    _steps(learner, 3)
    learner.checkpoint(final=True)  # no stop: step 3 written, and its time measured
    assert learner.checkpoints.measured is not None
    learner.checkpoints.stop_seen = time.monotonic() - 1  # the budget (0.9 s) is spent
    learner.checkpoints.last_step = 2  # as if step 3 were still to checkpoint
    (tmp_path / "ck" / "latest").write_text("step2")
    learner.checkpoint(final=True)
    assert (tmp_path / "ck" / "latest").read_text() == "step2"  # not written: skipped
