"""Building the configured policy back end (plain torch or DeepSpeed) behind the `Policy`
protocol; kept apart from the protocols so that scoring code can name them without
importing the back ends."""

from __future__ import annotations

from pathlib import Path

from learner.config import LearnerConfig
from learner.deepspeed_policy import DeepSpeedPolicy
from learner.dist import this_rank_device
from learner.model_io import load_model
from learner.policy import Policy
from learner.torch_policy import TorchPolicy


def build_policy(model_path: str | Path, cfg: LearnerConfig) -> Policy:
    """The configured engine over the model directory, on `learner.device` (DeepSpeed:
    its accelerator's, which `learner.device` must agree with)."""
    if cfg.engine == "deepspeed":  # fp32 master weights; bf16 is a DeepSpeed setting
        return DeepSpeedPolicy(load_model(model_path, "float32"), cfg)
    return TorchPolicy(load_model(model_path, cfg.dtype), cfg, this_rank_device(cfg.device))
