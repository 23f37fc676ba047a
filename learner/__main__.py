"""`dapo learner`: trains on informative groups and serves the new weights.

Under torchrun (WORLD_SIZE > 1) rank 0 runs the service and the other ranks follow it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from learner.config import LearnerSettings
from services.common.entry import role_main


def run(config: LearnerSettings) -> None:
    from services.common.malloc import keep_freed_memory
    from services.common.service import serve  # HTTP and gRPC stacks: not for --help

    if config.shared.torch_threads:  # several torch processes must not oversubscribe
        import torch

        torch.set_num_threads(config.shared.torch_threads)
    keep_freed_memory()  # weight buckets reuse warm memory (services/common/malloc.py)
    if int(os.environ.get("RANK", "0")) > 0:
        from learner.trainer import Follower

        Follower(config).run()
        return
    from learner.server import create_server

    serve("learner", create_server(config))


def main(argv: Sequence[str] | None = None) -> int:
    return role_main(
        "learner", LearnerSettings, run, argv, description=__doc__ or "", needs_redis=True
    )


if __name__ == "__main__":
    sys.exit(main())
