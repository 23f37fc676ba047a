"""`dapo reward`: the reward/verification service (gRPC + HTTP), until SIGINT/SIGTERM
or the end of the run."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from reward.config import RewardSettings
from services.common.entry import role_main


def run(config: RewardSettings) -> None:
    from reward.server import create_server
    from services.common.service import (
        idle_when_done,
        serve,
    )  # HTTP and gRPC stacks: not for --help

    serve("reward", create_server(config), idle_when_done(config, config.reward.server))


def main(argv: Sequence[str] | None = None) -> int:
    return role_main(
        "reward", RewardSettings, run, argv, description=__doc__ or "", needs_redis=False
    )


if __name__ == "__main__":
    sys.exit(main())
