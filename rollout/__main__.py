"""`dapo rollout`: serve one inference engine over gRPC."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from rollout.config import RolloutSettings
from services.common.entry import role_main


def run(config: RolloutSettings) -> None:
    from rollout.server import create_server
    from services.common.process import configure_process
    from services.common.service import idle_when_done, serve  # HTTP and gRPC: not for --help

    configure_process("rollout", config.shared.torch_threads)
    serve("rollout", create_server(config), idle_when_done(config, config.rollout.server))


def main(argv: Sequence[str] | None = None) -> int:
    return role_main(
        "rollout", RolloutSettings, run, argv, description=__doc__ or "", needs_redis=False
    )


if __name__ == "__main__":
    sys.exit(main())
