"""Random-weight Qwen2 models of a given shape, for the benchmarks, the GPU check and the
tests that need a model body other than a preset's (`learner.init_model` builds those)."""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING

from learner.init_model import ModelShape

if TYPE_CHECKING:
    from transformers import Qwen2ForCausalLM

# A body of ~7M parameters besides the embedding: 4 layers, hidden 256, tied head.
BENCH_SHAPE = ModelShape(256, 768, 4, 4, 2, 32768, True)


def random_qwen2(vocab_size: int, shape: ModelShape, seed: int = 0) -> Qwen2ForCausalLM:
    """A Qwen2 with random weights drawn after `torch.manual_seed(seed)` (global RNG), on
    the current default device."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=vocab_size, **asdict(shape))
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)
