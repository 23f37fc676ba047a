"""`dapo controller`: feeds prompts through rollout and reward into `scored`."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from services.common.entry import role_main
from services.controller.config import ControllerSettings


def run(config: ControllerSettings) -> None:
    from services.common.service import (
        idle_when_done,
        serve,
    )  # HTTP and gRPC stacks: not for --help
    from services.controller.server import create_server

    serve("controller", create_server(config), idle_when_done(config, config.controller.server))


def main(argv: Sequence[str] | None = None) -> int:
    return role_main(
        "controller", ControllerSettings, run, argv, description=__doc__ or "", needs_redis=True
    )


if __name__ == "__main__":
    sys.exit(main())
