"""Process lifecycle shared by the services: announce ports, stop on SIGINT/SIGTERM."""

from __future__ import annotations

import signal
import threading

PARENT_ENV = "DAPO_PARENT_PID"


def exit_with_parent(poll_s: float = 1.0, grace_s: float = 10.0) -> None:
    """If started by `dapo up`, SIGTERM ourselves once the launcher is gone, and exit
    anyway `grace_s` later (as `dapo up` itself would SIGKILL a straggler).

    Services run in their own session (so Ctrl-C reaches only the launcher, which stops
    them in order); without this, a launcher killed by SIGKILL would leave them running.
    The hard exit matters because the launcher's Redis dies with it, and a service may be
    inside a Redis call that keeps retrying through what looks like a Redis restart.
    """
    import os

    parent = os.environ.get(PARENT_ENV)
    if not parent:
        return

    def _watch() -> None:
        while os.getppid() == int(parent):
            threading.Event().wait(poll_s)
        os.kill(os.getpid(), signal.SIGTERM)
        threading.Event().wait(grace_s)
        os._exit(1)

    threading.Thread(target=_watch, daemon=True, name="parent-watch").start()


def stop_event_on_signals() -> threading.Event:
    """An Event set by SIGINT or SIGTERM (call from the main thread)."""
    stop = threading.Event()

    def _handler(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGINT, _handler)
    signal.signal(signal.SIGTERM, _handler)
    return stop


def announce(service: str, **ports: int) -> None:
    """Print the bound ports on one stdout line (port 0 in config means they were picked)."""
    fields = " ".join(f"{name}={port}" for name, port in ports.items())
    print(f"dapo {service} ready {fields}", flush=True)


def advertised_address(host: str, port: int) -> str:
    """host:port that other processes can dial (the hostname when bound to all interfaces)."""
    import socket

    return f"{socket.gethostname() if host in ('0.0.0.0', '::') else host}:{port}"
