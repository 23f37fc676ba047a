"""Publication off the training critical path (double-buffered).

Why: serializing a version into wire buckets is a full pass over the weights; done inside
the step, every step waits for it. Here the step only *snapshots* its weights (one copy
into a host buffer reused every other version; under ZeRO-3 this is where the weights are
gathered, bucket by bucket, on every rank) and returns; a background thread serializes
the snapshot into the `WeightServicer` while the next step trains.

At most one publication is in flight: `submit` for version N+1 takes its snapshot into
the other buffer, then waits until publication N is served before handing N+1 over. So
versions reach the servicer one by one, in order, and a buffer is overwritten only after
the publication that read it finished. The version protocol is unchanged: the step
commits its version to Redis after `submit`, and a rollout server that sees a version
the learner does not offer yet waits for it (`GetVersion`), as it always has.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable

import numpy

from learner.weights import WeightServicer
from services.common.tensor_codec import RawTensor

log = logging.getLogger(__name__)


class BackgroundPublisher:
    """Snapshots on the caller's thread, serializes and serves on a background one."""

    def __init__(self, servicer: WeightServicer) -> None:
        self.servicer = servicer
        self._buffers: list[dict[str, numpy.ndarray]] = [{}, {}]
        self._turn = 0
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.finished: list[tuple[int, float]] = []  # (version, monotonic time served)

    def submit(self, version: int, tensors: Iterable[RawTensor]) -> None:
        """Snapshot `tensors` now (they may view live weights), publish in the background."""
        snapshot = self._snapshot(tensors)
        self.wait()  # at most one in flight: N+1 is handed over once N is served
        self._thread = threading.Thread(
            target=self._publish, args=(version, snapshot), daemon=True, name="publish"
        )
        self._thread.start()

    def wait(self) -> None:
        """Until the publication in flight (if any) is served; re-raises its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _publish(self, version: int, snapshot: list[RawTensor]) -> None:
        try:
            self.servicer.publish(version, snapshot, total=len(snapshot))
            self.finished.append((version, time.monotonic()))
        except BaseException as exc:  # handed to the training thread by `wait`
            log.exception("publishing version %d failed", version)
            self._error = exc

    def _snapshot(self, tensors: Iterable[RawTensor]) -> list[RawTensor]:
        """Copies of `tensors` in this turn's buffer (kept, at their size, for reuse)."""
        buffers, self._turn = self._buffers[self._turn], 1 - self._turn
        out = []
        for raw in tensors:
            source = numpy.frombuffer(raw.data, dtype=numpy.uint8)
            buffer = buffers.get(raw.name)
            if buffer is None or buffer.size != source.size:
                buffer = buffers[raw.name] = numpy.empty(source.size, dtype=numpy.uint8)
            numpy.copyto(buffer, source)
            out.append(RawTensor(raw.name, raw.dtype, raw.shape, memoryview(buffer)))  # type: ignore[arg-type]
        return out
