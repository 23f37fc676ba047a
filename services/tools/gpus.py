"""Which GPUs each process of `dapo up` sees (its CUDA_VISIBLE_DEVICES).

The learner takes the first `learner.launch.ranks` GPUs (rank r on cuda:r of its own
set), then each rollout server the next `tensor_parallel_size` of them. A host with
fewer GPUs than that hands them out again from the first (several processes share a
GPU: one GPU runs the whole pipeline); a host without GPUs sets nothing. Torch-free: the
GPUs are counted from CUDA_VISIBLE_DEVICES or the NVIDIA driver's /proc entries.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from rollout.config import VllmEngineConfig
from services.common.errors import DapoError
from services.tools.config import DapoConfig

log = logging.getLogger(__name__)

DRIVER_GPUS = Path("/proc/driver/nvidia/gpus")


def host_gpus(environ: Mapping[str, str] = os.environ, driver_dir: Path = DRIVER_GPUS) -> list[str]:
    """The GPU ids `dapo up` may hand out: CUDA_VISIBLE_DEVICES's when set (empty or -1:
    none), else one per GPU the driver lists."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [g.strip() for g in visible.split(",") if g.strip()]
        return [] if not ids or ids[0] == "-1" else ids
    count = len(list(driver_dir.iterdir())) if driver_dir.is_dir() else 0
    return [str(i) for i in range(count)]


def rollout_names(rollouts: int) -> list[str]:
    """The launcher's child names of the rollout servers."""
    return ["rollout"] if rollouts == 1 else [f"rollout-{i}" for i in range(rollouts)]


def assign_gpus(
    gpus: Sequence[str], learner_ranks: int, rollouts: int, tensor_parallel: int
) -> dict[str, str]:
    """Child name → CUDA_VISIBLE_DEVICES for the learner and each rollout server."""
    if not gpus:
        return {}
    for setting, count in (
        ("learner.launch.ranks", learner_ranks),  # NCCL: one GPU per rank
        ("rollout.engine.tensor_parallel_size", tensor_parallel),
    ):
        if count > len(gpus):
            raise DapoError(
                f"{setting}={count} needs as many GPUs; this host has {len(gpus)} "
                f"({','.join(gpus)})"
            )

    def take(start: int, count: int) -> str:
        return ",".join(gpus[(start + i) % len(gpus)] for i in range(count))

    plan = {"learner": take(0, learner_ranks)}
    for i, name in enumerate(rollout_names(rollouts)):
        plan[name] = take(learner_ranks + i * tensor_parallel, tensor_parallel)
    return plan


def launch_gpus(config: DapoConfig, rollouts: int) -> dict[str, str]:
    """`assign_gpus` for this host and run; says so when processes must share a GPU."""
    engine = config.rollout.engine
    tensor_parallel = engine.tensor_parallel_size if isinstance(engine, VllmEngineConfig) else 1
    ranks = config.learner.launch.ranks
    gpus = host_gpus()
    plan = assign_gpus(gpus, ranks, rollouts, tensor_parallel)
    if plan and len(gpus) < ranks + rollouts * tensor_parallel:
        log.warning(
            "%d GPU(s) for %d learner rank(s) and %d rollout server(s) of %d: they share "
            "GPUs (%s)",
            len(gpus), ranks, rollouts, tensor_parallel,
            "; ".join(f"{name}={ids}" for name, ids in plan.items()),
        )  # fmt: skip
    return plan
