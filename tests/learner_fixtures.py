"""Shared by the learner tests: a fixed, length-skewed batch and data-parallel workers.

Run as a script under RANK/WORLD_SIZE/MASTER_*:

- `python tests/learner_fixtures.py grads MODEL OUT STAGES BUDGET` accumulates one
  mini-batch's gradient with DeepSpeed on this rank's share of the batch, per ZeRO stage;
  rank 0 writes the reduced gradients to OUT (safetensors);
- `python tests/learner_fixtures.py train MODEL OUT STAGES DTYPES` trains a few steps per
  ZeRO stage and dtype; rank 0 writes the final weights and each step's loss;
- `python tests/learner_fixtures.py gather MODEL OUT 3 -` publishes ZeRO-3 weights with a
  small `gather_bucket_bytes`, watching DeepSpeed's gathered parameters; rank 0 writes
  the peak of gathered bytes and whether the weights match a one-bucket gather (JSON).
"""

from __future__ import annotations

import os
import random
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from services.common.types import Group, Sample

if TYPE_CHECKING:
    import redis

    from services.tools.config import DapoConfig

VOCAB = 14  # the tiny preset's character tokenizer
EXACT = {"rtol": 0.0, "atol": 1e-12}  # `torch.testing.assert_close` on hand-computed fp64


def make_groups(n_groups: int = 4, group_size: int = 4, seed: int = 0) -> list[Group]:
    """Groups of mixed rewards whose responses range from 1 to 12 tokens."""
    rng = random.Random(seed)
    groups = []
    for g in range(n_groups):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(3, 7))]
        samples = []
        for k in range(group_size):
            length = rng.choice([1, 2, 3, 12]) if k else 12
            tokens = [rng.randrange(1, VOCAB) for _ in range(length)]
            logprobs = [-rng.uniform(1.5, 3.5) for _ in tokens]
            reward = 1.0 if (k + g) % 2 else -1.0
            samples.append(Sample(tokens, logprobs, "", "stop", 0, reward, reward > 0))
        groups.append(Group(f"g{seed}-{g}", f"p{g}", "", prompt, "", samples=samples))
    return groups


def fill_train(client: redis.Redis, run: str, n_groups: int, seed: int) -> list[str]:
    """Add `make_groups(n_groups, seed=seed)` to `run`'s train stream; their entry ids."""
    from services.common.adapters import encode_group
    from services.common.keys import RunKeys

    stream = RunKeys(run).train
    groups = make_groups(n_groups=n_groups, seed=seed)
    return [client.xadd(stream, {"group": encode_group(g)}).decode() for g in groups]


# A torch learner's fp32 step over `make_groups` in pieces of 4 responses and 64 tokens.
TORCH_FP32_STEP: dict[str, object] = {
    "learner.engine": "torch",
    "learner.dtype": "float32",
    "learner.optimizer.lr": 1e-2,
    "learner.batching.mini_batch_responses": 4,
    "learner.batching.micro_batch_tokens": 64,
}


def learner_config(
    model: Path, run: str, sets: Mapping[str, object], env: Mapping[str, str] | None = None
) -> DapoConfig:
    """The config of a learner on `model` that trains the `train` stream of `run` as
    `make_groups` fills it (16-token responses, no overlong buffer, no staleness limit),
    with the overrides `sets` (dotted keys) on top."""
    from services.tools.config import load_config

    base = {
        "shared.run_name": run,
        "shared.model_path": str(model),
        "shared.max_staleness": 100,
        "shared.max_response_length": 16,
        "shared.overlong_buffer_length": 0,
    }
    overrides = [f"{k}={v}" for k, v in {**base, **sets}.items()]
    return load_config(None, env=env, overrides=overrides)


def hand_logprobs(model, prompt: list[int], response: list[int], temperature: float = 1.0):
    """π(response token | prefix) `[n]` and the entropy `[n]` of each of those distributions,
    from one plain forward of the transformers `model` over prompt + response and a
    float64 log_softmax: the learner's numbers computed without the learner's code."""
    import torch

    ids = torch.tensor([[*prompt, *response]])
    logits = model(input_ids=ids).logits[0].double() / temperature
    log_p = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1]
    picked = log_p[torch.arange(len(response)), torch.tensor(response)]
    return picked, -(log_p.exp() * log_p).sum(dim=-1).detach()


def grads_worker(model: str, out: str, stage: int, micro_tokens: int) -> None:
    """One rank: π_old recompute, then accumulate one mini-batch on this rank's share."""
    import torch
    from safetensors.torch import save_file

    from learner.batch import sequences_from_groups
    from learner.batch_plan import plan_micro_batches, rank_share
    from learner.config import BatchingConfig, DeepSpeedConfig, LearnerConfig, OptimizerConfig
    from learner.deepspeed_policy import DeepSpeedPolicy
    from learner.dist import data_parallel
    from learner.model_io import load_model
    from learner.step import accumulate, recompute_old_logprobs

    cfg = LearnerConfig(
        engine="deepspeed",
        dtype="float32",
        deepspeed=DeepSpeedConfig(zero_stage=stage),
        optimizer=OptimizerConfig(lr=1e-3),
        batching=BatchingConfig(micro_batch_tokens=micro_tokens, logprob_chunk_tokens=5),
    )
    policy = DeepSpeedPolicy(load_model(model), cfg)
    dp = data_parallel()
    seqs = sequences_from_groups(make_groups())
    share = [seqs[i] for i in rank_share(seqs, list(range(len(seqs))), dp)]
    recompute_old_logprobs(policy, share, cfg, 0, 1.0, dp, fallback=seqs[0])
    for s in share:  # move π_old off π_θ so the clip branches matter
        s.old_logprobs = s.old_logprobs - 0.1 * torch.arange(len(s.response_ids))
    micro = len(plan_micro_batches(share, seqs[0], micro_tokens, dp, packed=cfg.batching.packing))
    accumulate(policy, share, cfg, 0, 1.0, 16, dp, fallback=seqs[0])
    grads = policy.full_gradients()
    if dp.rank == 0:
        save_file(grads, f"{out}.zero{stage}.safetensors", metadata={"micro_batches": str(micro)})


TRAIN_STEPS = 3


def train_worker(model: str, out: str, stage: int, dtype: str) -> None:
    """TRAIN_STEPS steps of the learner's defaults, but for the stage, dtype and batch size."""
    import json
    import time

    from safetensors.torch import save_file

    from learner.config import BatchingConfig, DeepSpeedConfig, LearnerConfig, OptimizerConfig
    from learner.deepspeed_policy import DeepSpeedPolicy
    from learner.dist import data_parallel
    from learner.model_io import load_model
    from learner.step import train_step

    cfg = LearnerConfig(
        dtype=dtype,
        deepspeed=DeepSpeedConfig(zero_stage=stage),
        optimizer=OptimizerConfig(lr=1e-3, warmup_steps=0),
        batching=BatchingConfig(mini_batch_responses=8, micro_batch_tokens=64),
    )
    started = time.monotonic()
    policy = DeepSpeedPolicy(load_model(model), cfg)
    dp, groups = data_parallel(), make_groups(seed=5)
    losses = [
        train_step(policy, groups, cfg, 0, 1.0, 16, seed=k, dp=dp).loss for k in range(TRAIN_STEPS)
    ]
    weights = {name: t.float().cpu().clone() for name, t in policy.named_weights()}
    if dp.rank == 0:
        meta = {"losses": json.dumps(losses), "seconds": f"{time.monotonic() - started:.2f}"}
        save_file(weights, f"{out}.zero{stage}.{dtype}.safetensors", metadata=meta)


def broadcast_check(out: str) -> None:
    """Rank 0 sends a batch as bytes; each rank writes a marker if it got it intact, over
    the group DeepSpeed made (gloo here), its tensors on the CPU that backend needs."""
    from pathlib import Path

    import torch

    from learner.dist import TorchDist, data_parallel, pack_groups, unpack_groups

    dp = data_parallel()
    assert isinstance(dp, TorchDist) and dp.device == torch.device("cpu"), dp
    payload = pack_groups(make_groups(seed=7))
    got = dp.broadcast_bytes(payload if dp.rank == 0 else None)
    if got == payload and len(unpack_groups(got)) == 4:
        Path(f"{out}.rank{dp.rank}.broadcast-ok").touch()


def gather_worker(model: str, out: str) -> None:
    """Peak bytes of ZeRO-3 parameters gathered at once while `named_weights` streams."""
    import json

    import torch
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    import learner.deepspeed_policy as dsp
    from learner.config import DeepSpeedConfig, LearnerConfig
    from learner.model_io import load_model

    base = dsp.ds_config  # every parameter sharded (the tiny model's would all persist)
    dsp.ds_config = lambda cfg: (
        base(cfg)
        | {  # type: ignore[assignment]
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}
        }
    )
    policy = dsp.DeepSpeedPolicy(
        load_model(model), LearnerConfig(dtype="float32", deepspeed=DeepSpeedConfig(zero_stage=3))
    )
    params = [p for p in policy.module.parameters() if not getattr(p, "ds_persist", False)]
    sizes = [dsp.full_bytes(p) for p in params]
    peak, owned = [0], dsp._owned

    def watched(tensor: torch.Tensor) -> torch.Tensor:  # called inside each gather
        available = [p.ds_status == ZeroParamStatus.AVAILABLE for p in params]
        peak[0] = max(peak[0], sum(s for s, a in zip(sizes, available, strict=True) if a))
        return owned(tensor)

    dsp._owned = watched  # type: ignore[assignment]
    policy.cfg.publication.gather_bucket_bytes = 10**12  # everything at once, for comparison
    whole = {n: t.clone() for n, t in policy.named_weights()}
    whole_peak, peak[0] = peak[0], 0
    policy.cfg.publication.gather_bucket_bytes = bucket = max(1024, sum(sizes) // 6)
    streamed = {n: t.clone() for n, t in policy.named_weights()}
    same = streamed.keys() == whole.keys() and all(
        torch.equal(streamed[n], whole[n]) for n in whole
    )
    if torch.distributed.get_rank() == 0:
        result = {
            "peak": peak[0],
            "bucket": bucket,
            "largest": max(sizes),
            "total": sum(sizes),
            "same": same,
            "whole_peak": whole_peak,
            "names": sorted(whole),
            "count": policy.weight_count(),
        }
        with open(out, "w") as f:
            json.dump(result, f)


def teardown() -> None:
    """Both ranks done before either closes the process group: a rank that exits while
    its peer's gloo threads still talk to it can abort the peer at exit ("terminate
    called without an active exception", seen under load)."""
    import torch

    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    _, cmd, model_dir, out_path, stages, last = sys.argv
    if cmd == "gather":
        gather_worker(model_dir, out_path)
    else:
        for zero in stages.split(","):
            if cmd == "grads":
                grads_worker(model_dir, out_path, int(zero), int(last))
            else:
                for dtype in last.split(","):
                    train_worker(model_dir, out_path, int(zero), dtype)
        if cmd == "grads":
            broadcast_check(out_path)
    teardown()
