"""Errors that the CLI turns into one clear line and a non-zero exit (no traceback wall)."""

from __future__ import annotations


class DapoError(Exception):
    """A user-facing failure: bad config, missing file, busy port, unreachable Redis."""


class PortInUseError(DapoError):
    """A requested port is already taken."""
