"""A version's weight buckets as wire frames, readable while they are still being written.

A `FrameLog` is offered as soon as publication starts, so building the frames overlaps
the transfer. A frame is parts (protobuf metadata `bytes`, views into the publisher's
snapshot) that join to exactly one serialized `WeightBucket`; the snapshot therefore
outlives every reader (docs/weight_publication.md, "The path").
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from services.weight_transport.weight_socket import Frame, WeightSocketError


class PublicationFailed(WeightSocketError):
    """The publication this stream was reading broke off (its error is the cause): the
    weight socket closes the stream without its end marker, so the reader fails over."""


class FrameLog:
    """Append-only frames of one version; iterating yields them as they arrive, to the end."""

    def __init__(self) -> None:
        self._frames: list[Frame] = []
        self._closed = False
        self._error: BaseException | None = None
        self._cond = threading.Condition()

    def append(self, frame: Frame) -> None:
        with self._cond:
            self._frames.append(frame)
            self._cond.notify_all()

    def close(self, error: BaseException | None = None) -> None:
        """No more frames: complete, or broken off by `error` (readers then raise)."""
        with self._cond:
            self._closed, self._error = True, error
            self._cond.notify_all()

    def nbytes(self) -> int:
        """The bytes of every frame (what one stream sends, less the length prefixes);
        waits for the writer."""
        return sum(len(part) for frame in self for part in frame)

    def __iter__(self) -> Iterator[Frame]:
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
