"""Where temporary files go: TMPDIR for child processes and `tempfile` for this one."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def tmpdir_at(path: Path) -> Iterator[Path]:
    """TMPDIR (inherited by the processes started meanwhile) and `tempfile` pointed at
    `path` until the block ends; then both as they were."""
    saved = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"], tempfile.tempdir = str(path), str(path)
    try:
        yield path
    finally:
        if saved[0] is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved[0]
        tempfile.tempdir = saved[1]
