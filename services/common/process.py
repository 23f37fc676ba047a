"""What a role sets up in its own process before it does any work.

One function for `dapo learner`, `dapo rollout` and every benchmark that times or measures
one of them, so a benchmark row runs in a process configured exactly as the role's (the
record it returns goes into the benchmark's result file): torch threads, so processes on
one machine do not oversubscribe its cores, and malloc tuned for rollout servers only
(`services.common.malloc`; why not the learner: docs/weight_publication.md, "The path").
"""

from __future__ import annotations

from typing import Any, Literal

Role = Literal["learner", "rollout"]
TUNES_MALLOC: dict[Role, bool] = {"learner": False, "rollout": True}


def configure_process(role: Role, torch_threads: int | None) -> dict[str, Any]:
    """Apply `role`'s process settings; what was applied (threads, malloc tuned or not)."""
    if torch_threads:
        import torch

        torch.set_num_threads(torch_threads)
    tuned = False
    if TUNES_MALLOC[role]:
        from services.common.malloc import keep_freed_memory

        tuned = keep_freed_memory()
    return {"role": role, "torch_threads": torch_threads, "malloc_tuned": tuned}
