"""A relay chain of rollout servers: the learner sends each weight byte once.

Rollout server i (in the registry's instance order) pulls from server i - 1, and only the
first from the learner; each forwards every bucket as soon as it assembled it (views of
its tensors, no copy), so the chain streams. `Reception` is one version arriving,
`RelayServer` the listening side; a child whose parent fails falls back to the learner.
Order, memory, timeouts and security: docs/weight_publication.md, "The relay chain".
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import socket
import struct
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from services.common.security import TlsConfig
from services.weight_transport import weight_socket
from services.weight_transport.assembly import (
    Assembled,
    AssembledBuckets,
    Assembling,
    WeightAssembler,
)
from services.weight_transport.frame_reader import PlacedBuckets
from services.weight_transport.tensor_codec import wire_bucket_parts
from services.weight_transport.weight_socket import (
    FRAME,
    Frame,
    WeightSocketError,
    close_listener,
    recv_exact,
    send_frame,
)

log = logging.getLogger(__name__)

REQUEST = struct.Struct("<Q32s")  # the lowest version taken, sha256 of the token
# A parent holds a child's request this many relay timeouts for a version to arrive; the
# child gives up sooner (`first_frame_timeout`).
ACQUIRE_WAITS = 10
MAX_CHILDREN = 4  # connections served at once (a chain has one child; a few retries)


def token_digest(token: str | None) -> bytes:
    """What a relay request carries for the shared token (32 zero bytes when auth is off)."""
    return hashlib.sha256(token.encode()).digest() if token else bytes(32)


class Reception:
    """One version arriving: a thread receives its buckets into this server's assembler
    (in place, from a weight socket), the updater checks each as it lands (`buckets`),
    and each assembled bucket is kept, as views into the assembled tensors, for relay
    children (`iter_parts`)."""

    def __init__(self, cond: threading.Condition) -> None:
        self.version: int | None = None
        self.received = 0  # buckets assembled
        self.parts: list[Frame] = []  # assembled frames, for children
        self.done = False  # every frame read (or the transfer failed)
        self.error: Exception | None = None
        # no reference back to self: a cycle would keep the version's tensors (their
        # recycled memory) until the garbage collector runs, not until the next version
        self.assembler = WeightAssembler(on_bucket=_keep_for_children(self.parts, cond))
        self._taken: dict[int, Assembled] = {}  # assembled, not yet seen by the updater
        self._cond = cond  # the hub's: it waits for versions

    def start(
        self, sock: socket.socket, max_frame_bytes: int, first_timeout: float | None = None
    ) -> Reception:
        """Receive a weight socket's frames (the socket's timeout applies per read;
        `first_timeout`, when given, to the first frame)."""
        return self._spawn(PlacedBuckets(sock, max_frame_bytes, self.assembler, first_timeout))

    def start_frames(self, frames: Iterable[bytes]) -> Reception:
        """Receive frames read elsewhere (the FetchWeights stream's messages)."""
        return self._spawn(Assembling.of_frames(frames, self.assembler))

    def _spawn(self, items: AssembledBuckets) -> Reception:
        thread = threading.Thread(target=self._run, args=(items,), daemon=True, name="relay-recv")
        thread.start()
        return self

    def _run(self, items: AssembledBuckets) -> None:
        try:
            for item in items:
                with self._cond:
                    if self.error is not None:
                        return  # the updater gave up (a stale version, a bad tensor)
                    if self.version is None:
                        self.version = item[0].version
                    self._taken[self.received] = item
                    self.received += 1
                    self._cond.notify_all()
        except Exception as exc:  # the transfer's error is every reader's error
            self.fail(exc)
        finally:
            items.close()  # the socket goes with it, also when the updater gave up
            with self._cond:
                self.done = True
                self._cond.notify_all()

    def fail(self, exc: BaseException) -> None:
        """End this reception for every reader (the updater gave up, or the socket broke)."""
        with self._cond:
            if self.error is None:
                self.error = exc if isinstance(exc, WeightSocketError) else WeightSocketError(exc)
            self._cond.notify_all()

    def buckets(self) -> Iterator[Assembled]:
        """The buckets in order as they are assembled, with the tensors each completed,
        for this server's updater."""
        index = 0
        while True:
            with self._cond:
                self._cond.wait_for(lambda at=index: at in self._taken or self.done or self.error)  # type: ignore[misc]
                if self.error is not None:
                    raise self.error
                item = self._taken.pop(index, None)
            if item is None:
                return
            yield item
            index += 1

    def iter_parts(self) -> Iterator[Frame]:
        """Every assembled frame in order, for a child; raises if the transfer failed."""
        index = 0
        while True:
            with self._cond:
                self._cond.wait_for(lambda at=index: len(self.parts) > at or self._ended(at))  # type: ignore[misc]
                if len(self.parts) > index:
                    parts = self.parts[index]
                elif self.error is not None:
                    raise self.error
                else:
                    return
            yield parts
            index += 1

    def _ended(self, index: int) -> bool:
        return self.error is not None or (self.done and index >= len(self.parts))


def _keep_for_children(
    parts: list[Frame], cond: threading.Condition
) -> Callable[[Any, list[memoryview]], None]:
    """What a reception's assembler calls when a bucket is in its tensors: children may
    have it (its frame, as views into the tensors)."""

    def keep(bucket: Any, views: list[memoryview]) -> None:
        frame = wire_bucket_parts(bucket, views)
        with cond:
            parts.append(frame)
            cond.notify_all()

    return keep


class RelayedBuckets(AssembledBuckets):
    """A reception's buckets, as a weight source returns them: `Assembled` items from the
    reception's `assembler`. Abandoning them ends the reception for its relay children
    too (the reception's thread closes the socket)."""

    def __init__(self, reception: Reception) -> None:
        self.reception = reception
        self.assembler = reception.assembler

    def __iter__(self) -> Iterator[Assembled]:
        return self.reception.buckets()

    def abandon(self, error: BaseException) -> None:
        self.reception.fail(error)

    def close(self) -> None:
        """Nothing to release here: the reception's thread closes its socket."""


class RelayHub:
    """The reception of the latest version this server fetched (what it relays)."""

    def __init__(self, max_frame_bytes: int, timeout_s: float) -> None:
        self.max_frame_bytes, self.timeout_s = max_frame_bytes, timeout_s
        self.current: Reception | None = None
        self._cond = threading.Condition()

    def receive(self, sock: socket.socket, first_timeout: float | None = None) -> RelayedBuckets:
        """Read a new version from a weight socket (in a thread) and relay it; its buckets."""
        return self._begin(lambda r: r.start(sock, self.max_frame_bytes, first_timeout))

    def receive_frames(self, frames: Iterable[bytes]) -> RelayedBuckets:
        """The same for frames read elsewhere (the FetchWeights stream)."""
        return self._begin(lambda r: r.start_frames(frames))

    def _begin(self, start: Callable[[Reception], Reception]) -> RelayedBuckets:
        with self._cond:  # the last version's tensors go once its children are done
            reception = self.current = start(Reception(self._cond))
            self._cond.notify_all()
        return RelayedBuckets(reception)

    def acquire(self, min_version: int, timeout: float) -> Reception | None:
        """A reception of `min_version` or newer (waiting for one up to `timeout`)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._offers(min_version), timeout):
                return None
            return self.current

    def _offers(self, min_version: int) -> bool:
        reception = self.current
        return (
            reception is not None
            and reception.error is None
            and (reception.version or 0) >= min_version
        )


class RelayServer:
    """Serves the hub's frames to children: one thread per connection, a few at once."""

    def __init__(
        self, hub: RelayHub, host: str, port: int, tls: TlsConfig, token: str | None
    ) -> None:
        self.hub, self._digest = hub, token_digest(token)
        self._context = weight_socket.server_context(tls)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family)
        self.port: int = self._listener.getsockname()[1]
        self._slots = threading.BoundedSemaphore(MAX_CHILDREN)
        self._thread = threading.Thread(target=self._accept, daemon=True, name="relay")

    def start(self) -> RelayServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        close_listener(self._listener, self._thread)

    def _accept(self) -> None:
        while True:
            try:
                conn, peer = self._listener.accept()
            except OSError:
                return  # closed by stop()
            if not self._slots.acquire(blocking=False):
                conn.close()
                continue
            threading.Thread(
                target=self._serve, args=(conn, peer), daemon=True, name="relay-child"
            ).start()

    def _serve(self, conn: socket.socket, peer: object) -> None:
        try:
            conn.settimeout(10.0)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._context is not None:
                conn = self._context.wrap_socket(conn, server_side=True)
            min_version, digest = REQUEST.unpack(recv_exact(conn, REQUEST.size))
            if not hmac.compare_digest(digest, self._digest):
                log.warning("relay: wrong token from %s", peer)
                return
            reception = self.hub.acquire(min_version, ACQUIRE_WAITS * self.hub.timeout_s)
            if reception is None:
                return  # nothing new enough: the child pulls from the learner
            self._stream(conn, reception)
        except (OSError, WeightSocketError) as exc:
            log.info("relay: child %s ended: %s", peer, exc)
        finally:
            conn.close()
            self._slots.release()

    def _stream(self, conn: socket.socket, reception: Reception) -> None:
        conn.settimeout(self.hub.timeout_s)
        for parts in reception.iter_parts():
            send_frame(conn, parts)
        conn.sendall(FRAME.pack(0))
        weight_socket.linger(conn)


def connect(
    host: str, port: int, min_version: int, tls: TlsConfig, token: str | None, timeout_s: float
) -> socket.socket:
    """A socket to a parent's relay that has sent its request (TLS as configured)."""
    request = REQUEST.pack(min_version, token_digest(token))
    return weight_socket.connect(host, port, request, tls, timeout_s)


def relay_parent(entries: list[dict[str, Any]], instance: str) -> dict[str, Any] | None:
    """The rollout server before `instance` among those that relay (registry order, by
    instance name): where we pull from; None for the head of the chain (it pulls from
    the learner) or when we are not registered yet."""
    chain = [e for e in entries if e.get("relay")]
    at = chain_index(chain, instance)
    return chain[at - 1] if at else None


def chain_index(entries: list[dict[str, Any]], instance: str) -> int | None:
    """Our place in the chain (0: its head), None when not registered as relaying."""
    names = [e["instance"] for e in entries if e.get("relay")]
    return names.index(instance) if instance in names else None


def first_frame_timeout(index: int, timeout_s: float) -> float:
    """How long server `index` of the chain waits for its parent's first frame: longer
    than its parent waits for its own (a stalled server up the chain costs each server
    below one more timeout before its parent falls back to the learner and streams)."""
    return (index + 1) * timeout_s
