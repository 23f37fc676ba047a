"""A version's serialized weight buckets, readable while they are still being written.

Why: serializing a version is a full pass over the weights (a copy of every byte). When a
rollout server could only start fetching once the last bucket was serialized, that pass
and the transfer ran one after the other. A `FrameLog` is offered as soon as publication
starts: each reader streams the buckets already written and waits for the next, so the
serialization overlaps the transfer (and, behind a relay, every server's reception).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from services.common.weight_socket import WeightSocketError


class PublicationFailed(WeightSocketError):
    """The publication this stream was reading broke off (its error is the cause): the
    weight socket closes the stream without its end marker, so the reader fails over."""


class FrameLog:
    """Append-only frames of one version; iterating yields them as they arrive, to the end."""

    def __init__(self) -> None:
        self._frames: list[bytes] = []
        self._closed = False
        self._error: BaseException | None = None
        self._cond = threading.Condition()

    def append(self, frame: bytes) -> None:
        with self._cond:
            self._frames.append(frame)
            self._cond.notify_all()

    def close(self, error: BaseException | None = None) -> None:
        """No more frames: complete, or broken off by `error` (readers then raise)."""
        with self._cond:
            self._closed, self._error = True, error
            self._cond.notify_all()

    def frames(self) -> list[bytes]:
        """Every frame, once the log is complete (waits for the writer)."""
        return list(self)

    def __iter__(self) -> Iterator[bytes]:
        at = 0
        while True:
            with self._cond:
                while at >= len(self._frames) and not self._closed:
                    self._cond.wait()
                if at >= len(self._frames):
                    if self._error is not None:
                        raise PublicationFailed("the publication broke off") from self._error
                    return
                frame = self._frames[at]
            yield frame
            at += 1
