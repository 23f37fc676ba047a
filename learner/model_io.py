"""Models and training state in and out of files: transformers directories, safetensors.

Nothing here unpickles: training state is safetensors (tensors) plus JSON (structure).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from transformers import PreTrainedModel


def load_model(model_path: str | Path, dtype: str = "float32") -> PreTrainedModel:
    """A causal LM from a local transformers directory (no hub)."""
    from transformers import AutoModelForCausalLM

    torch_dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype)


def enable_activation_checkpointing(model: PreTrainedModel) -> None:
    """Recompute each decoder layer in backward instead of keeping its activations.

    Non-reentrant: it needs no input that requires grad and works under DeepSpeed
    ZeRO-3's parameter hooks. (transformers 5 renamed `gradient_checkpointing_enable`.)
    """
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # probe-ok: transformers 5 vs 4
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def unique_weights(module: torch.nn.Module) -> list[tuple[str, Tensor]]:
    """The module's state, each tensor once: a tied weight (one Parameter under two names,
    the LM head and the embedding of a tied model) under its first name only. Rollout
    engines cover the other name by the tie (`rollout.engine_base.uncovered`; vLLM
    skips a tied head), so publishing it again would send the same bytes twice: 22% of
    a Qwen2.5-0.5B. The tensors are the module's own (`keep_vars`): detach before use."""
    seen: set[int] = set()
    out = []
    for name, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            out.append((name, tensor))
    return out


def save_hf(
    module: PreTrainedModel,
    state: dict[str, Tensor],
    out_dir: str | Path,
    tokenizer_dir: str | Path | None,
) -> None:
    """`save_pretrained` with the given full weights, plus the tokenizer if known."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    module.save_pretrained(out, state_dict=state)
    if tokenizer_dir is not None:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)


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
