"""Checks across a run's config and what it points at, made before any service starts.

The config schema refuses what the config alone shows to be wrong (an overlong buffer as
long as the response, a vLLM context shorter than prompt + response). What needs the model
directory or the machine is checked here: lengths against the model's positions, the size
of a model the torch engine would evaluate, tensor parallelism against the GPUs a rollout
server gets, the tokenizers of the roles, the training and eval data as a careful user
reads them. Errors stop `dapo up`; warnings are printed and the run goes on.
"""

from __future__ import annotations

import json
import math
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from services.common.errors import DapoError
from services.tools.config import DapoConfig

# Above this many parameters the torch engine (Hugging Face generate in the launcher's
# process) is too slow to sample an avg@32 evaluation; vLLM is meant for it.
TORCH_EVAL_MAX_PARAMS = 3_000_000_000


@dataclass
class Findings:
    """What a check found: errors refuse the run, warnings are printed."""

    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def add(self, error: str | None = None, warning: str | None = None) -> None:
        if error is not None:
            self.errors.append(error)
        if warning is not None:
            self.warnings.append(warning)


def model_positions(model_dir: Path) -> int | None:
    """`max_position_embeddings` of a Hugging Face model directory (None if unknown)."""
    try:
        value = json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        return None
    return value if isinstance(value, int) else None


def safetensors_parameters(path: Path) -> int:
    """Parameters in one .safetensors file, from its JSON header (the tensors are not read)."""
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    return sum(math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__")


def model_parameters(model_dir: Path) -> int | None:
    """Parameters of the model's safetensors weights (None without any)."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        return None
    try:
        return sum(safetensors_parameters(f) for f in files)
    except (OSError, ValueError, KeyError, struct.error):
        return None


def length_problem(prompt: int, response: int, positions: int | None, model: str) -> str | None:
    """Prompt + response must fit the model's positions (generation past them is garbage)."""
    if positions is None or prompt + response <= positions:
        return None
    return (
        f"shared.max_prompt_length + shared.max_response_length ({prompt} + {response} = "
        f"{prompt + response}) exceeds the {positions} positions of the model in {model} "
        f"(max_position_embeddings); shorten them"
    )


def eval_data_warning(config: DapoConfig) -> str | None:
    """A file dataset has no held-out split of its own: no eval.data means no evaluation."""
    from services.controller.dataset import eval_data_spec

    cfg = config.controller.eval
    if not cfg.enabled or eval_data_spec(cfg, config.controller.dataset) is not None:
        return None
    return (
        f"no held-out evaluation: controller.dataset.kind is {config.controller.dataset.kind} "
        f"and controller.eval.data is not set (e.g. aime-2024.parquet); set it, or "
        f"controller.eval.enabled=false to say so"
    )


def torch_eval_warning(config: DapoConfig, parameters: int | None) -> str | None:
    """The torch engine evaluating a large model on the launcher's machine."""
    cfg = config.controller.eval
    if cfg.engine != "torch" or parameters is None or parameters <= TORCH_EVAL_MAX_PARAMS:
        return None
    from services.controller.dataset import eval_data_spec

    if not cfg.enabled or eval_data_spec(cfg, config.controller.dataset) is None:
        return None
    return (
        f"controller.eval.engine is torch for a model of {parameters / 1e9:.1f}B parameters "
        f"(> {TORCH_EVAL_MAX_PARAMS / 1e9:.0f}B): the evaluations before and after training "
        f"run Hugging Face generate in `dapo up`'s process; set controller.eval.engine=vllm"
    )


def tensor_parallel_problem(config: DapoConfig, gpus: int | None, where: str) -> str | None:
    """A vLLM rollout server shards the model over tensor_parallel_size GPUs: it must get
    that many (`gpus`, None = unknown). docs/deploy.md says how each deployment sizes it."""
    engine = config.rollout.engine
    if engine.kind != "vllm" or gpus is None or engine.tensor_parallel_size <= gpus:
        return None
    return (
        f"rollout.engine.tensor_parallel_size is {engine.tensor_parallel_size} but a rollout "
        f"server {where} gets {gpus} GPU{'s' if gpus != 1 else ''}; give each server that "
        f"many GPUs or lower tensor_parallel_size (docs/deploy.md)"
    )


def local_gpus(config: DapoConfig) -> int | None:
    """GPUs a rollout server of `dapo up` sees (CUDA_VISIBLE_DEVICES applied): all of this
    machine's. None when it does not matter (not vLLM) or cannot be known (no torch, or no
    GPU at all: vLLM's CPU build)."""
    if config.rollout.engine.kind != "vllm":
        return None
    try:
        import torch
    except ImportError:
        return None
    count = int(torch.cuda.device_count())
    return count or None


def check_run(config: DapoConfig, gpus: int | None = None) -> Findings:
    """Everything checkable before a run starts on this machine; `gpus`: what a local
    rollout server sees (None = not checked)."""
    found = Findings()
    found.add(warning=eval_data_warning(config))
    found.add(error=tensor_parallel_problem(config, gpus, "on this machine"))
    found.add(error=tokenizer_problem(config))
    model = config.model_path
    if model is None or not Path(model).is_dir():
        return found
    lengths = (config.shared.max_prompt_length, config.shared.max_response_length)
    found.add(error=length_problem(*lengths, model_positions(Path(model)), model))
    found.add(warning=torch_eval_warning(config, model_parameters(Path(model))))
    return found


def tokenizer_problem(config: DapoConfig) -> str | None:
    """One model path decides every role's tokenizer: a rollout.model_path whose tokenizer
    differs from shared.model_path's (the controller's) would sample other prompts than the
    controller rendered."""
    rollout, shared = config.rollout.model_path, config.shared.model_path
    if rollout is None or shared is None or Path(rollout) == Path(shared):
        return None
    if not (Path(rollout).is_dir() and Path(shared).is_dir()):
        return None
    from services.common.tokenizer import load_tokenizer

    theirs, ours = load_tokenizer(rollout, False), load_tokenizer(shared, False)
    if theirs.fingerprint == ours.fingerprint:
        return None
    return (
        f"the tokenizer of rollout.model_path {rollout} ({theirs.fingerprint}) differs from "
        f"shared.model_path {shared}'s ({ours.fingerprint}), which renders the prompts; "
        "one model path must decide every role's tokenizer"
    )


def report_data(config: DapoConfig, command: str, out: TextIO = sys.stdout) -> None:
    """Load the training data and `controller.eval.data` as the controller will, print their
    load lines to `out` and their warnings; DapoError for data a run cannot use."""
    from services.common.data_screen import require_usable
    from services.common.tokenizer import load_tokenizer
    from services.controller.dataset import (
        check_kind,
        dataset_source,
        eval_data_spec,
        load_eval_data,
    )
    from services.tools.liveness import check_training_data

    cfg, shared = config.controller, config.shared
    check_kind(cfg.dataset)  # a config mistake is named before any model is read
    tokenizer = load_tokenizer(shared.model_path, cfg.apply_chat_template)
    train = check_training_data(config, tokenizer)
    print(train.describe(), file=out)
    warnings = list(train.warnings)
    spec = eval_data_spec(cfg.eval, cfg.dataset)
    if cfg.eval.enabled and spec is not None:
        training = (train.records, dataset_source(cfg.dataset))
        held_out = load_eval_data(
            spec, cfg.eval.limit, tokenizer, shared.max_prompt_length, training
        )
        try:
            require_usable(held_out)
        except ValueError as exc:
            raise DapoError(f"controller.eval.data: {exc}") from None
        print(f"eval {held_out.describe()}", file=out)
        warnings += held_out.warnings
    report(Findings(warnings=warnings), command)


def report(found: Findings, command: str) -> None:
    """Print the warnings; raise one DapoError holding every error."""
    for warning in found.warnings:
        print(f"dapo {command}: warning: {warning}", file=sys.stderr)
    if found.errors:
        raise DapoError("; ".join(found.errors))
