"""The policy being trained, behind a narrow interface the DAPO step drives.

`TorchPolicy` is a plain torch model + AdamW with linear warm-up and gradient clipping.
The step calls `forward` and `backward` once per micro-batch and `step` once per
mini-batch; `backward` never rescales the loss (the DAPO loss is already divided by the
global token count of the mini-batch), so accumulation adds exact gradients.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from learner.config import LearnerConfig


class Policy(Protocol):
    """What the DAPO step needs from a training engine."""

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """Logits `[B, L, V]`."""
        ...

    def backward(self, loss: Tensor, last: bool = True) -> None:
        """Accumulate gradients of `loss` (no scaling); `last`: the mini-batch's last one."""
        ...

    def step(self) -> float:
        """Clip, apply and zero the accumulated gradients; return the pre-clip grad norm."""
        ...

    def advance_schedule(self) -> None:
        """One rollout step done (the warm-up counts rollout steps)."""
        ...

    def lr(self) -> float: ...

    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """Full (gathered) weights for publishing to rollout servers."""
        ...

    def save_checkpoint(self, directory: str | Path, tag: str, client_state: dict) -> None:
        """Everything needed to resume, plus `client_state`; `latest` is written last."""
        ...

    def load_checkpoint(self, directory: str | Path) -> dict | None:
        """Restore `latest`; its client state (None when there is no checkpoint)."""
        ...

    def save_pretrained(self, out_dir: str | Path, tokenizer_dir: str | Path | None) -> None:
        """Export the full model as a transformers directory."""
        ...


def _split(obj: Any, key: str, tensors: dict[str, Tensor]) -> Any:
    """A JSON-able copy of nested state with each tensor replaced by a reference."""
    if isinstance(obj, Tensor):
        tensors[key] = obj.detach().cpu().contiguous()
        return {"__tensor__": key}
    if isinstance(obj, dict):
        return {"__dict__": [[k, _split(v, f"{key}.{k}", tensors)] for k, v in obj.items()]}
    if isinstance(obj, list | tuple):
        return [_split(v, f"{key}.{i}", tensors) for i, v in enumerate(obj)]
    return obj


def _join(obj: Any, tensors: dict[str, Tensor]) -> Any:
    if isinstance(obj, dict) and "__tensor__" in obj:
        return tensors[obj["__tensor__"]]
    if isinstance(obj, dict):
        return {k: _join(v, tensors) for k, v in obj["__dict__"]}
    if isinstance(obj, list):
        return [_join(v, tensors) for v in obj]
    return obj


def save_state(state: dict, directory: Path) -> None:
    """Nested training state as safetensors (tensors) + JSON (structure): no pickle."""
    from safetensors.torch import save_file

    tensors: dict[str, Tensor] = {}
    structure = _split(state, "s", tensors)
    seen: set[int] = set()
    for key, tensor in tensors.items():  # tied weights share storage; safetensors refuses it
        if tensor.numel() and tensor.data_ptr() in seen:
            tensors[key] = tensor.clone()
        seen.add(tensor.data_ptr())
    save_file(tensors, str(directory / "state.safetensors"))
    (directory / "state.json").write_text(json.dumps(structure))


def load_state(directory: Path) -> dict:
    """Inverse of `save_state`."""
    from safetensors.torch import load_file

    tensors = load_file(str(directory / "state.safetensors"))
    return _join(json.loads((directory / "state.json").read_text()), tensors)


def warmup_factor(step: int, warmup_steps: int) -> float:
    """Linear warm-up from 1/warmup_steps to 1, then constant (the paper's schedule)."""
    if warmup_steps <= 0:
        return 1.0
    return min(1.0, (step + 1) / warmup_steps)


def load_model(model_path: str | Path, dtype: str = "float32") -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch_dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype)


class TorchPolicy:
    """Single-process torch training (CPU or one GPU)."""

    def __init__(self, model: torch.nn.Module, cfg: LearnerConfig, device: str = "cpu"):
        self.model = model.to(device)
        self.model.train()
        self.cfg = cfg
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: warmup_factor(s, cfg.warmup_steps)
        )

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        device = next(self.model.parameters()).device
        out = self.model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device))
        return out.logits

    def backward(self, loss: Tensor, last: bool = True) -> None:
        loss.backward()

    def step(self) -> float:
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def advance_schedule(self) -> None:
        """One rollout step done: warm-up counts rollout steps, not gradient updates."""
        self.scheduler.step()

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        yield from self.model.state_dict().items()

    def save_pretrained(self, out_dir: str | Path, tokenizer_dir: str | Path | None) -> None:
        from learner.deepspeed_policy import save_hf

        save_hf(self.model, dict(self.model.state_dict()), out_dir, tokenizer_dir)

    def save_checkpoint(self, directory: str | Path, tag: str, client_state: dict) -> None:
        """Model, optimizer, schedule and `client_state` in one file; `latest` written last."""
        root = Path(directory)
        (root / tag).mkdir(parents=True, exist_ok=True)
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "client": client_state,
        }
        save_state(state, root / tag)
        tmp = root / "latest.tmp"
        tmp.write_text(tag)
        tmp.replace(root / "latest")

    def load_checkpoint(self, directory: str | Path) -> dict | None:
        """Restore the latest checkpoint; its client state, or None if there is none."""
        latest = Path(directory) / "latest"
        if not latest.is_file():
            return None
        state = load_state(Path(directory) / latest.read_text().strip())
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        return state["client"]


def build_policy(model_path: str | Path, cfg: LearnerConfig) -> Policy:
    """The configured engine over the model directory."""
    if cfg.engine == "deepspeed":
        from learner.deepspeed_policy import DeepSpeedPolicy

        return DeepSpeedPolicy(load_model(model_path, "float32"), cfg)
    return TorchPolicy(load_model(model_path, cfg.dtype), cfg)
