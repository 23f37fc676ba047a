"""`dapo controller`: feeds prompts through rollout and reward into `scored`."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from services.common.entry import role_main
from services.common.lifecycle import announce, stop_event_on_signals
from services.common.redis_server import connect_run
from services.controller.config import ControllerSettings


def run(config: ControllerSettings) -> None:
    from services.controller.server import create_server

    stop = stop_event_on_signals()
    controller, http = create_server(config, connect_run(config))
    announce("controller", http=http.port)
    try:
        controller.run(stop)
    finally:
        http.stop()


def main(argv: Sequence[str] | None = None) -> int:
    return role_main(
        "controller", ControllerSettings, run, argv, description=__doc__ or "", needs_redis=True
    )


if __name__ == "__main__":
    sys.exit(main())
