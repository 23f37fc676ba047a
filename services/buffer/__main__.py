"""`dapo buffer`: the dynamic-sampling filter service."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from services.buffer.config import BufferSettings
from services.common.entry import role_main
from services.common.lifecycle import announce, stop_event_on_signals
from services.common.redis_server import connect_run


def run(config: BufferSettings) -> None:
    from services.buffer.server import create_server

    stop = stop_event_on_signals()
    buffer, http = create_server(config, connect_run(config))
    announce("buffer", http=http.port)
    try:
        buffer.run(stop)
    finally:
        http.stop()


def main(argv: Sequence[str] | None = None) -> int:
    return role_main(
        "buffer", BufferSettings, run, argv, description=__doc__ or "", needs_redis=True
    )


if __name__ == "__main__":
    sys.exit(main())
