"""`dapo learner`: trains on informative groups and serves the new weights.

Under torchrun (WORLD_SIZE > 1) rank 0 runs the service and the other ranks follow it;
with `learner.launch.ranks > 1` the command starts torchrun itself (learner/launch.py).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from learner.config import LearnerSettings
from services.common.entry import role_main


def run(config: LearnerSettings, role_args: Sequence[str] = ()) -> None:
    from learner.launch import exec_torchrun, under_torchrun
    from services.common.process import configure_process

    if config.learner.launch.ranks > 1 and not under_torchrun():
        exec_torchrun(config.learner.launch, role_args)
    configure_process("learner", config.shared.torch_threads)
    if not under_torchrun():
        serve_rank0(config)
        return
    try:
        if int(os.environ.get("RANK", "0")) > 0:
            follow(config)
        else:
            serve_rank0(config)
    except SystemExit as exc:
        exit_now(exc.code if isinstance(exc.code, int) else 1)
    exit_now(0)


def serve_rank0(config: LearnerSettings) -> None:
    from learner.server import create_server
    from services.common.service import serve  # HTTP and gRPC stacks: not for --help

    serve("learner", create_server(config))


def follow(config: LearnerSettings) -> None:
    """A rank > 0: SIGTERM asks rank 0 for a checkpoint (it must not kill this rank, whose
    shard the checkpoint needs); exit with the code rank 0 sends."""
    from learner.trainer import Follower
    from services.common.lifecycle import stop_event_on_signals

    code = Follower(config, stopping=stop_event_on_signals()).run()
    if code:
        raise SystemExit(code)


def exit_now(code: int) -> None:
    """End a rank without interpreter teardown: its checkpoint is on disk and its group
    closed, and module finalization (a full garbage collection of torch, transformers and
    DeepSpeed) took ~10 s per rank here, inside torchrun's SIGKILL deadline."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    role_args = list(sys.argv[1:] if argv is None else argv)
    return role_main(
        "learner",
        LearnerSettings,
        lambda config: run(config, role_args),
        argv,
        description=__doc__ or "",
        needs_redis=True,
    )


if __name__ == "__main__":
    sys.exit(main())
