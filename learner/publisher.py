"""Publication off the training critical path.

The step pays only for its own copy of the weights into a pooled snapshot (under ZeRO-3,
gathered bucket by bucket on every rank); a background thread hands the snapshot to the
`WeightServicer`, which serves it as it is. At most one publication is in flight, so
versions reach the servicer one by one, in order. How, and what the step waits for:
docs/weight_publication.md, "Off the critical path".
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

from learner.weights import WeightServicer
from services.weight_transport.tensor_codec import RawTensor

log = logging.getLogger(__name__)


class BackgroundPublisher:
    """Snapshots on the caller's thread (or, with `overlap`, on its own), publishes on a
    background one."""

    def __init__(self, servicer: WeightServicer) -> None:
        self.servicer = servicer
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._reads_weights = False  # the thread in flight copies the live weights
        self.finished: list[tuple[int, float]] = []  # (version, monotonic time served)

    def submit(
        self,
        version: int,
        tensors: Iterable[RawTensor],
        total: int | None = None,
        overlap: bool = False,
    ) -> None:
        """Publish `tensors` (they may view live weights) in the background. The copy into
        a snapshot happens now, or with `overlap` in the background as well, the version
        offered from its first bucket: then the weights must stay put until `settle()`
        (the caller's next optimizer step waits for it), and reading them must take no
        collective (ZeRO-3's gathers must run on the training thread, in step)."""
        self.wait()  # at most one in flight; N superseded N-1, whose snapshot may be free
        self._reads_weights = overlap
        if overlap:
            self._start(version, lambda: self.servicer.publish(version, tensors, total))
            return
        pool = self.servicer.pool
        snapshot = pool.take()
        try:
            copies = list(snapshot.fill(tensors))
        except BaseException:
            pool.give_back(snapshot)  # never handed over: nothing reads it
            raise
        self._start(version, lambda: self.servicer.publish_snapshot(version, snapshot, copies))

    def settle(self) -> None:
        """Until the publication thread is done with the weights: with `overlap` it copies
        them, so call this before they change. That thread ends once the last bucket is
        copied (rollout servers go on streaming the snapshot); its error, if any, is raised
        by the next `wait`. Without `overlap` the weights were copied in `submit`."""
        if self._thread is not None and self._reads_weights:
            self._thread.join()

    def wait(self) -> None:
        """Until the publication in flight (if any) is served; re-raises its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _start(self, version: int, publish: Callable[[], None]) -> None:
        self._thread = threading.Thread(
            target=self._publish, args=(version, publish), daemon=True, name="publish"
        )
        self._thread.start()

    def _publish(self, version: int, publish: Callable[[], None]) -> None:
        try:
            publish()
            self.finished.append((version, time.monotonic()))
        except BaseException as exc:  # handed to the training thread by `wait`
            log.exception("publishing version %d failed", version)
            self._error = exc
