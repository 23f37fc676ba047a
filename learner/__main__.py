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
    from services.common.process import configure_process
    from services.common.service import serve  # HTTP and gRPC stacks: not for --help

    configure_process("learner", config.shared.torch_threads)
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
