"""`DeepSpeedPolicy`: the `Policy` protocol on a DeepSpeed engine (ZeRO 0–3, fp32/bf16).

DAPO's normalisation survives DeepSpeed because the step marks the accumulation boundary
itself, backward never divides by the accumulation count, and the loss is multiplied by
the world size so DeepSpeed's gradient average becomes the exact sum. How, and the
optimizer, learning rate and CPU all-reduce choices: docs/architecture.md, "Data-parallel
learner".
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from transformers import PreTrainedModel

from learner.async_checkpoint import PendingWrite, snapshot
from learner.attention import packed_attention
from learner.config import LearnerConfig
from learner.logprobs import final_hidden_states, output_head
from learner.model_io import enable_activation_checkpointing, save_hf, unique_weights
from learner.optim import adamw, warmup_factor
from services.common.errors import DapoError
from services.common.net import free_port
from services.weight_transport.buckets import runs_by_size


def init_distributed(cfg: LearnerConfig) -> None:
    """Join (or create, for a single process) the torch.distributed group DeepSpeed uses."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() == "cpu" and not cfg.deepspeed.cpu_shm_allreduce:
        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # type: ignore[attr-defined]
    backend = group_backend(get_accelerator().device_name())
    if not torch.distributed.is_initialized() and "TORCHELASTIC_RESTART_COUNT" in os.environ:
        torch.distributed.init_process_group(
            backend,
            store=attempt_store(),
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
        )
    if not torch.distributed.is_initialized() and "WORLD_SIZE" not in os.environ:
        # A world of one, without writing launcher variables into os.environ: child
        # processes (e.g. services started by this one) must not inherit them.
        torch.distributed.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
        )
        os.environ.setdefault("LOCAL_RANK", "0")  # DeepSpeed's engine asserts it is set
    deepspeed.init_distributed(dist_backend=backend)


def group_backend(accelerator: str) -> str:
    """The process group's backend for DeepSpeed's accelerator: NCCL on CUDA (ZeRO's
    collectives on GPU tensors), gloo on CPU. `learner.dist.backend_device` follows it."""
    return "nccl" if accelerator == "cuda" else "gloo"


def device_mismatch(setting: str, accelerator: str) -> str | None:
    """Why `learner.device` cannot hold under DeepSpeed, which trains on its accelerator's
    device (cuda when the machine has one); None when it can."""
    if setting == "auto" or setting.split(":")[0] == accelerator:
        return None
    return (
        f"learner.device={setting}, but DeepSpeed's accelerator here is {accelerator}: "
        f"use learner.device=auto, or learner.engine=torch"
        + (", or DS_ACCELERATOR=cpu in the learner's environment" if setting == "cpu" else "")
    )


def attempt_store() -> torch.distributed.Store:
    """torchrun's store, under a prefix of this restart's own.

    torchrun keeps one rendezvous store across the group's restarts, so without a prefix
    a restarted rank read the dead group's gloo addresses and every restart failed
    ("connectFullMesh failed ... Connection refused").
    """
    from datetime import timedelta

    agent_hosts_it = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = torch.distributed.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=not agent_hosts_it and os.environ["RANK"] == "0",
        timeout=timedelta(minutes=30),
    )
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    return torch.distributed.PrefixStore(f"dapo/attempt_{attempt}/", store)


def ds_config(cfg: LearnerConfig) -> dict[str, Any]:
    """The DeepSpeed config of one learner (the step owns accumulation and the lr)."""
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": cfg.optimizer.grad_clip,
        "zero_optimization": {"stage": cfg.deepspeed.zero_stage},
        "bf16": {"enabled": cfg.dtype == "bfloat16"},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def copy_overlaps(zero_stage: int) -> bool:
    """Whether a weight copy may run beside the next step: not under ZeRO-3, which
    gathers each weight in a collective that must run on the training thread."""
    return zero_stage != 3


class DeepSpeedPolicy:
    """A Hugging Face causal LM trained by a DeepSpeed engine."""

    def __init__(self, model: PreTrainedModel, cfg: LearnerConfig) -> None:
        import deepspeed
        from deepspeed.accelerator import get_accelerator

        if why := device_mismatch(cfg.device, get_accelerator().device_name()):
            raise DapoError(why)
        init_distributed(cfg)
        self.cfg, self.schedule_step = cfg, 0
        self.weight_copy_overlaps = copy_overlaps(cfg.deepspeed.zero_stage)
        self.world_size = torch.distributed.get_world_size()
        if cfg.batching.gradient_checkpointing:
            enable_activation_checkpointing(model)
        if cfg.batching.packing:
            packed_attention(model, get_accelerator().device_name())
        self.optimizer = adamw(model.parameters(), cfg)
        self.engine, *_ = deepspeed.initialize(
            model=model, optimizer=self.optimizer, config=ds_config(cfg)
        )
        # from_pretrained leaves the model in eval mode, and transformers checkpoints a
        # layer only while `self.training`: without this, checkpointing did nothing.
        self.engine.train()
        self._set_lr()

    @property
    def module(self) -> PreTrainedModel:
        module = self.engine.module
        assert isinstance(module, PreTrainedModel)
        return module

    @property
    def device(self) -> torch.device:
        return self.engine.device

    def hidden_states(
        self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor | None = None
    ) -> Tensor:
        """Through the engine's forward: its hooks (ZeRO-3 gathers, backward prologue) run."""
        ids, mask = input_ids.to(self.device), attention_mask.to(self.device)
        return final_hidden_states(self.engine, ids, mask, position_ids)

    @property
    def lm_head(self) -> torch.nn.Module:
        """Called as a module, so ZeRO-3 gathers its (partitioned) weight in its hooks."""
        return output_head(self.module)

    def backward(self, loss: Tensor, last: bool = True) -> None:
        """Accumulate `loss`'s gradient; `last` marks the mini-batch's last micro-batch."""
        self.engine.set_gradient_accumulation_boundary(last)
        self.engine.backward(loss * self.world_size, scale_wrt_gas=False)

    def step(self) -> float:
        """Clip and apply the reduced gradients; return the pre-clip global grad norm."""
        fallback = self._stage0_fp32_norm()
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return float(norm if norm is not None else fallback)

    def _stage0_fp32_norm(self) -> float:
        """DeepSpeed reports no norm for plain fp32 stage 0; grads are full there."""
        if self.cfg.deepspeed.zero_stage > 0 or self.cfg.dtype != "float32":
            return 0.0
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        return float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0

    def advance_schedule(self) -> None:
        """One rollout step done: warm-up counts rollout steps, not gradient updates."""
        self.schedule_step += 1
        self._set_lr()

    def _set_lr(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.cfg.optimizer.lr * warmup_factor(
                self.schedule_step, self.cfg.optimizer.warmup_steps
            )

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    # ------------------------------------------------------------ weights out
    def weight_count(self) -> int:
        return len(unique_weights(self.module))

    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """Full weights in `state_dict` order; under ZeRO-3 gathered a bucket of at most
        `publication.gather_bucket_bytes` at a time (each yielded tensor a copy, the gathered ones
        released before the next bucket), so no rank ever holds the whole model.

        Every rank must drain this iterator (the gathers are collectives).
        """
        import deepspeed

        for group in gather_groups(
            unique_weights(self.module), self.cfg.publication.gather_bucket_bytes
        ):
            sharded = [t for _, t in group if hasattr(t, "ds_id")]  # probe-ok: ZeRO-3 params
            gathering = deepspeed.zero.GatheredParameters(sharded, modifier_rank=None)
            with gathering if sharded else contextlib.nullcontext():
                copies = [(n, _owned(t)) for n, t in group]
            yield from copies

    def full_gradients(self) -> dict[str, Tensor]:
        """Reduced fp32 gradients by parameter name (after the last backward, before step)."""
        from deepspeed.utils import safe_get_full_grad

        out = {}
        for name, p in self.module.named_parameters():
            grad = safe_get_full_grad(p)
            if grad is not None:
                out[name] = grad.detach().float().cpu().clone()
        return out

    def save_pretrained(self, out_dir: str | Path, tokenizer_dir: str | Path | None) -> None:
        """Export a transformers model directory (rank 0 writes; every rank gathers)."""
        state = {name: t.cpu() for name, t in self.named_weights()}
        if torch.distributed.get_rank() == 0:
            save_hf(self.module, state, out_dir, tokenizer_dir)

    # ------------------------------------------------------------ checkpoints
    def save_checkpoint(self, directory: str | Path, tag: str, client_state: dict) -> None:
        """Engine, optimizer and this class's schedule; `latest` is written last."""
        state = dict(client_state, schedule_step=self.schedule_step)
        self.engine.save_checkpoint(str(directory), tag=tag, client_state=state)

    def checkpoint_snapshot(
        self, directory: str | Path, tag: str, client_state: dict
    ) -> list[PendingWrite]:
        """What `save_checkpoint` writes, copied to host memory and not yet written, nor
        `latest` (a collective, like it: DeepSpeed's barriers; each rank its shard)."""
        state = dict(client_state, schedule_step=self.schedule_step)
        real = self.engine.checkpoint_engine
        deferred, pending = deferred_engine(real)
        self.engine.checkpoint_engine = deferred
        try:
            self.engine.save_checkpoint(
                str(directory), tag=tag, client_state=state, save_latest=False
            )
        finally:
            self.engine.checkpoint_engine = real
        return pending

    def load_checkpoint(self, directory: str | Path) -> dict | None:
        """Restore the latest checkpoint; its client state, or None if there is none."""
        if not (Path(directory) / "latest").is_file():
            return None
        path, client = self.engine.load_checkpoint(str(directory))
        if path is None:
            return None
        self.schedule_step = int(client.get("schedule_step", 0))
        self._set_lr()
        return client


def deferred_engine(real: Any) -> tuple[Any, list[PendingWrite]]:
    """A DeepSpeed checkpoint engine that copies each state it is given to save (into the
    list returned with it) instead of writing it; loads and directories go to `real`."""
    pending: list[PendingWrite] = []
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

    class Deferred(CheckpointEngine):
        def __init__(self) -> None:
            super().__init__()
            self.name = "DapoDeferred"

        def create(self, info: Any) -> None:
            pass

        def save(self, state_dict: Any, path: str) -> None:
            pending.append(PendingWrite(Path(path), snapshot(state_dict)))

        def load(self, path: str, map_location: Any = None) -> Any:
            return real.load(path, map_location)

        def commit(self, info: Any) -> bool:
            return True

        def makedirs(self, path: str, exist_ok: bool = False) -> None:
            real.makedirs(path, exist_ok=exist_ok)

    return Deferred(), pending


def _owned(tensor: Tensor) -> Tensor:
    """A gathered ZeRO-3 weight copied to host memory (its gathered storage goes with the
    bucket); any other weight as it is."""
    gathered = hasattr(tensor, "ds_id")  # probe-ok: DeepSpeed marks ZeRO-3 params (third party)
    return tensor.detach().to("cpu", copy=True) if gathered else tensor.detach()


def full_bytes(tensor: Tensor) -> int:
    """A parameter's gathered size (`ds_numel` under ZeRO-3, its own size otherwise)."""
    numel = getattr(tensor, "ds_numel", tensor.numel())  # probe-ok: a DeepSpeed ZeRO-3 param
    return int(numel) * tensor.element_size()


def gather_groups(
    named: list[tuple[str, Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, Tensor]]]:
    """Consecutive runs of weights of at most `bucket_bytes` gathered (one larger weight
    alone), in order."""
    return runs_by_size(named, full_bytes, bucket_bytes)
