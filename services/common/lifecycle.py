"""Process lifecycle shared by the services: announce ports, stop on SIGINT/SIGTERM."""

from __future__ import annotations

import signal
import threading


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
