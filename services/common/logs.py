"""Structured logging: one `key=value` line per event, tagged with the service name."""

from __future__ import annotations

import logging
import os
import sys

FORMAT = "%(asctime)s %(levelname)s service=%(service)s %(name)s: %(message)s"


class _ServiceFilter(logging.Filter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def filter(self, record: logging.LogRecord) -> bool:
        record.service = self.service
        return True


def setup_logging(service: str, level: str | None = None) -> None:
    """Configure the root logger once per process (level from arg or DAPO_LOG_LEVEL)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT, datefmt="%H:%M:%S"))
    handler.addFilter(_ServiceFilter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level or os.environ.get("DAPO_LOG_LEVEL", "INFO"))
    for noisy in ("httpx", "uvicorn.access", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def kv(**fields: object) -> str:
    """Render fields as `k=v` pairs for a log line."""
    return " ".join(f"{k}={v}" for k, v in fields.items())
