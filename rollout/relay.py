"""A relay chain of rollout servers: the learner sends each weight byte once.

Why: when every rollout server pulls from the learner, the learner sends R copies of
every version. Here rollout server i (in the registry's instance order) pulls from server
i - 1 instead, and only the first pulls from the learner. Each server keeps the frames it
receives (serialized `WeightBucket`s, exactly the weight socket's frames) in a pool
reused from version to version, and serves them to the next server *as they arrive*: a
bucket is forwarded while the next one is still on the wire, so the chain streams rather
than storing and forwarding the whole model.

`Reception` is one version arriving: a thread reads the frames from a socket into the
pool; the server's own `WeightUpdater` and any relay children read them in order.
`RelayServer` is the listening side (same frames, same TLS as the learner's weight
socket; a request names the lowest version the child takes and carries a digest of the
shared token). A child whose parent is gone, slow past `relay_timeout_s`, or serving an
older version gets an error and pulls from the learner (the fallback path); so does a
late joiner whose parent already moved on.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import socket
import struct
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from rollout.config import RolloutSettings
from services.common import weight_socket
from services.common.security import TlsConfig
from services.common.tensor_codec import parse_bucket
from services.common.weight_socket import FRAME, WeightSocketError, recv_exact

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
    """One version's frames, read into a pool by a thread and read back in order."""

    def __init__(self, pool: list[bytearray], cond: threading.Condition | None = None) -> None:
        self.pool = pool
        self.frames: list[memoryview] = []
        self.version: int | None = None
        self.done = False
        self.error: Exception | None = None
        self.readers = 0  # relay children streaming these frames (the pool is theirs)
        self._cond = cond or threading.Condition()  # the hub's: it waits for versions

    def start(
        self, sock: socket.socket, max_frame_bytes: int, first_timeout: float | None = None
    ) -> Reception:
        """Receive from a weight socket's frames, straight into the pool (the socket's
        timeout applies per read; `first_timeout`, when given, to the first frame)."""
        frames = self._from_socket(sock, max_frame_bytes, first_timeout)
        return self._spawn(frames, sock.close)

    def start_frames(self, frames: Iterable[bytes]) -> Reception:
        """Receive already-read frames (the FetchWeights stream), copied into the pool."""
        return self._spawn(self._copied(frames), lambda: None)

    def _spawn(self, views: Iterator[memoryview], close: Callable[[], None]) -> Reception:
        threading.Thread(target=self._run, args=(views, close), daemon=True,
                         name="relay-recv").start()  # fmt: skip
        return self

    def _run(self, views: Iterator[memoryview], close: Callable[[], None]) -> None:
        try:
            for view in views:
                with self._cond:
                    if self.version is None:
                        self.version = parse_bucket(view).version
                    self.frames.append(view)
                    self._cond.notify_all()
        except Exception as exc:  # the transfer's error is every reader's error
            self.error = exc if isinstance(exc, WeightSocketError) else WeightSocketError(exc)
        finally:
            close()
            with self._cond:
                self.done = True
                self._cond.notify_all()

    def _from_socket(
        self, sock: socket.socket, max_frame_bytes: int, first_timeout: float | None
    ) -> Iterator[memoryview]:
        header, timeout = bytearray(FRAME.size), sock.gettimeout()
        if first_timeout is not None:
            sock.settimeout(first_timeout)
        while True:
            recv_exact(sock, FRAME.size, memoryview(header))
            (size,) = FRAME.unpack(header)
            if size == 0:
                return
            if size > max_frame_bytes:
                raise WeightSocketError(f"relay frame of {size} bytes > {max_frame_bytes}")
            view = self._slot(len(self.frames), size)
            recv_exact(sock, size, view)
            sock.settimeout(timeout)
            yield view

    def _copied(self, frames: Iterable[bytes]) -> Iterator[memoryview]:
        for frame in frames:
            view = self._slot(len(self.frames), len(frame))
            view[:] = frame
            yield view

    def _slot(self, index: int, size: int) -> memoryview:
        """A buffer of the pool for frame `index` (grown or added when too small)."""
        if index == len(self.pool):
            self.pool.append(bytearray(size))
        elif len(self.pool[index]) < size:
            self.pool[index] = bytearray(size)
        return memoryview(self.pool[index])[:size]

    def iter_frames(self) -> Iterator[memoryview]:
        """Every frame in order; raises if the transfer failed or stalled (a partial
        version is never complete). The receiving thread's socket timeouts bound waits."""
        index = 0
        while True:
            with self._cond:
                self._cond.wait_for(lambda at=index: self._has(at))  # type: ignore[misc]
                if len(self.frames) <= index:
                    if self.error is not None:
                        raise self.error
                    return
                frame = self.frames[index]
            yield frame
            index += 1

    def _has(self, index: int) -> bool:
        return len(self.frames) > index or self.done

    def buckets(self) -> Iterator[object]:
        return map(parse_bucket, self.iter_frames())


class RelayHub:
    """The reception of the latest version this server fetched (what it relays)."""

    def __init__(self, max_frame_bytes: int, timeout_s: float) -> None:
        self.max_frame_bytes, self.timeout_s = max_frame_bytes, timeout_s
        self.current: Reception | None = None
        self._pool: list[bytearray] = []
        self._cond = threading.Condition()

    def receive(self, sock: socket.socket, first_timeout: float | None = None) -> Iterator[object]:
        """Read a new version from a weight socket (in a thread) and relay it; its buckets."""
        return self._begin(lambda r: r.start(sock, self.max_frame_bytes, first_timeout))

    def receive_frames(self, frames: Iterable[bytes]) -> Iterator[object]:
        """The same for frames read elsewhere (the FetchWeights stream)."""
        return self._begin(lambda r: r.start_frames(frames))

    def _begin(self, start: Callable[[Reception], Reception]) -> Iterator[object]:
        with self._cond:
            busy = self.current is not None and self.current.readers > 0
            if busy:  # a child still reads the last version: never overwrite its frames
                self._pool = []
            reception = self.current = start(Reception(self._pool, self._cond))
            self._cond.notify_all()
        return reception.buckets()

    def acquire(self, min_version: int, timeout: float) -> Reception | None:
        """A reception of `min_version` or newer (waiting for one up to `timeout`)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._offers(min_version), timeout):
                return None
            reception = self.current
            assert reception is not None
            reception.readers += 1
            return reception

    def _offers(self, min_version: int) -> bool:
        reception = self.current
        return (
            reception is not None
            and reception.error is None
            and (reception.version or 0) >= min_version
        )

    def release(self, reception: Reception) -> None:
        with self._cond:
            reception.readers -= 1


class RelayServer:
    """Serves the hub's frames to children: one thread per connection, a few at once."""

    def __init__(self, hub: RelayHub, host: str, port: int, tls: TlsConfig,
                 token: str | None) -> None:  # fmt: skip
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
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        self._thread.join(timeout=5)

    def _accept(self) -> None:
        while True:
            try:
                conn, peer = self._listener.accept()
            except OSError:
                return  # closed by stop()
            if not self._slots.acquire(blocking=False):
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn, peer), daemon=True,
                             name="relay-child").start()  # fmt: skip

    def _serve(self, conn: socket.socket, peer: object) -> None:
        try:
            conn.settimeout(10.0)
            if self._context is not None:
                conn = self._context.wrap_socket(conn, server_side=True)
            min_version, digest = REQUEST.unpack(recv_exact(conn, REQUEST.size))
            if not hmac.compare_digest(digest, self._digest):
                log.warning("relay: wrong token from %s", peer)
                return
            reception = self.hub.acquire(min_version, ACQUIRE_WAITS * self.hub.timeout_s)
            if reception is None:
                return  # nothing new enough: the child pulls from the learner
            try:
                self._stream(conn, reception)
            finally:
                self.hub.release(reception)
        except (OSError, WeightSocketError) as exc:
            log.info("relay: child %s ended: %s", peer, exc)
        finally:
            conn.close()
            self._slots.release()

    def _stream(self, conn: socket.socket, reception: Reception) -> None:
        conn.settimeout(self.hub.timeout_s)
        for frame in reception.iter_frames():
            conn.sendall(FRAME.pack(len(frame)))
            conn.sendall(frame)
        conn.sendall(FRAME.pack(0))
        weight_socket.linger(conn)


def connect(host: str, port: int, min_version: int, tls: TlsConfig, token: str | None,
            timeout_s: float) -> socket.socket:  # fmt: skip
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


@dataclass
class RelaySource:
    """The previous rollout server's relay: a weight source that may break off (then the
    learner's sources are tried next, see `rollout.weights.pull`)."""

    parent: dict[str, Any]  # its registry entry (address, relay port)
    index: int  # ours in the chain
    min_version: int
    hub: RelayHub
    config: RolloutSettings
    name: str = "relay"
    fallible: bool = True

    def fetch(self) -> Iterator[Any] | None:
        host = self.parent["address"].rsplit(":", 1)[0].strip("[]")
        security = self.config.security
        try:
            sock = connect(host, int(self.parent["relay"]), self.min_version, security.tls,
                           security.auth.secret(), self.config.rollout.relay_timeout_s)  # fmt: skip
        except OSError as exc:
            log.warning("relay %s unreachable (%s); pulling from the learner", host, exc)
            return None
        timeout = self.config.rollout.relay_timeout_s
        return self.hub.receive(sock, first_frame_timeout(self.index, timeout))
