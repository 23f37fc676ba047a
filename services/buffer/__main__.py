"""`dapo buffer`: the dynamic-sampling filter service."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from services.buffer.config import BufferSettings
from services.common.entry import role_main


def run(config: BufferSettings) -> None:
    from services.buffer.server import create_server
    from services.common.service import (
        idle_when_done,
        serve,
    )  # HTTP and gRPC stacks: not for --help

    serve("buffer", create_server(config), idle_when_done(config, config.buffer.server))


def main(argv: Sequence[str] | None = None) -> int:
    return role_main(
        "buffer", BufferSettings, run, argv, description=__doc__ or "", needs_redis=True
    )


if __name__ == "__main__":
    sys.exit(main())
