"""Record every file created or written under directory trees (Linux inotify, via ctypes).

Why inotify rather than comparing listings before and after: a staging file that is
written and deleted within the watched interval (a `TemporaryDirectory`) leaves no trace
in a listing, but its creation is an event. Every directory that exists when the watch
starts is watched, so any new entry anywhere in the trees (a new directory included) and
any write to an existing file is seen; entries inside a directory created meanwhile are
not, but that directory's own creation is.
"""

from __future__ import annotations

import ctypes
import os
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

IN_MODIFY, IN_CLOSE_WRITE, IN_MOVED_TO, IN_CREATE = 0x2, 0x8, 0x80, 0x100
IN_Q_OVERFLOW, IN_NONBLOCK = 0x4000, 0o4000
_MASK = IN_MODIFY | IN_CLOSE_WRITE | IN_MOVED_TO | IN_CREATE
_HEADER = struct.Struct("iIII")  # wd, mask, cookie, len


class TreeWatch:
    """inotify watches on every directory under `roots`; `writes()` drains the events."""

    def __init__(self, *roots: str | Path) -> None:
        self._libc = ctypes.CDLL("libc.so.6", use_errno=True)
        self._fd = self._libc.inotify_init1(IN_NONBLOCK)
        if self._fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1 failed")
        self._dirs: dict[int, str] = {}
        for root in roots:
            for directory, _, _ in os.walk(root):
                wd = self._libc.inotify_add_watch(self._fd, os.fsencode(directory), _MASK)
                if wd < 0:
                    raise OSError(ctypes.get_errno(), f"cannot watch {directory}")
                self._dirs[wd] = directory

    def writes(self) -> list[str]:
        """Paths created, written or moved in since the last call (an overflow counts)."""
        paths: list[str] = []
        while True:
            try:
                data = os.read(self._fd, 1 << 16)
            except BlockingIOError:
                return paths
            offset = 0
            while offset < len(data):
                wd, mask, _, length = _HEADER.unpack_from(data, offset)
                offset += _HEADER.size
                name = data[offset : offset + length].rstrip(b"\0").decode(errors="replace")
                offset += length
                if mask & IN_Q_OVERFLOW:
                    paths.append("<inotify queue overflow: writes were lost>")
                else:
                    paths.append(os.path.join(self._dirs.get(wd, "?"), name))

    def close(self) -> None:
        os.close(self._fd)


@contextmanager
def watch_writes(*roots: str | Path) -> Iterator[list[str]]:
    """Yield a list that holds, after the block, every path written under `roots` in it."""
    watch = TreeWatch(*roots)
    written: list[str] = []
    try:
        yield written
        written.extend(watch.writes())
    finally:
        watch.close()
