"""`dapo learner` with several ranks: the same command, re-executed under torchrun.

With `learner.launch.ranks > 1` and no launcher around it (no LOCAL_RANK), the process
execs itself (same PID) as `torchrun --standalone --nproc-per-node=N -m learner <the same
arguments>`: rank 0 serves and trains, the others follow it. What torchrun does on
SIGTERM and when a rank dies: docs/reliability.md, "The learner as several ranks".
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from learner.config import LearnerLaunch
from services.common.lifecycle import PARENT_ENV


def under_torchrun() -> bool:
    """True inside a rank that torchrun (or another launcher) started."""
    return "LOCAL_RANK" in os.environ


def torchrun_command(launch: LearnerLaunch, role_args: Sequence[str]) -> list[str]:
    """The torchrun command line that runs `dapo learner <role_args>` as `launch.ranks` ranks."""
    return [
        sys.executable,
        "-m",
        "learner.launch",  # torchrun's main (`torchrun_main`)
        "--standalone",
        f"--nproc-per-node={launch.ranks}",
        f"--max-restarts={launch.max_restarts}",
        f"--shutdown-timeout={launch.shutdown_timeout_s}",
        "-m",
        "learner",
        *role_args,
    ]


def torchrun_main(argv: Sequence[str]) -> int:
    """torchrun's own main; a SIGTERM/SIGINT that stopped the ranks (they checkpointed)
    ends it with 128 + the signal, as the signal would, and one line instead of torchrun's
    traceback."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main

    try:
        main(list(argv))
    except SignalException as exc:
        print(f"dapo learner: stopped by signal {int(exc.sigval)}", file=sys.stderr)
        return 128 + int(exc.sigval)
    return 0


def exec_torchrun(launch: LearnerLaunch, role_args: Sequence[str]) -> NoReturn:
    """Become torchrun running this learner's ranks (this never returns)."""
    env = dict(os.environ)
    if PARENT_ENV in env:  # started by `dapo up`: follow it through torchrun
        from services.common.redis_server import die_with_parent

        die_with_parent()  # survives exec: torchrun gets SIGTERM if the launcher dies
        env[PARENT_ENV] = str(os.getpid())  # the ranks' parent is torchrun: this PID
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, torchrun_command(launch, role_args), env)


if __name__ == "__main__":  # torchrun, as `exec_torchrun` starts it
    sys.exit(torchrun_main(sys.argv[1:]))
