"""`dapo rollout`: serve one inference engine over gRPC."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from rollout.config import RolloutSettings
from services.common.entry import role_main


def run(config: RolloutSettings) -> None:
    from rollout.server import create_server
    from services.common.malloc import keep_freed_memory
    from services.common.service import (
        idle_when_done,
        serve,
    )  # HTTP and gRPC stacks: not for --help

    if config.shared.torch_threads:  # several torch processes must not oversubscribe
        import torch

        torch.set_num_threads(config.shared.torch_threads)
    keep_freed_memory()  # received weights reuse warm memory (services/common/malloc.py)
    serve("rollout", create_server(config), idle_when_done(config, config.rollout.server))


def main(argv: Sequence[str] | None = None) -> int:
    return role_main(
        "rollout", RolloutSettings, run, argv, description=__doc__ or "", needs_redis=False
    )


if __name__ == "__main__":
    sys.exit(main())
