"""The weights' data plane: serialized weight buckets over a plain (or TLS) TCP socket.

gRPC Python hands every received message to Python as a fresh `bytes` object with the GIL
held, which caps FetchWeights at about 0.5-0.6x of raw loopback TCP; here the client reads
each bucket into a reused buffer and the server sends each frame's parts with one
scatter/gather `sendmsg` (`send_frame`, for the learner and relays alike), close to raw
TCP speed. Tickets, frames, TLS and bounds: docs/weight_publication.md, "The weight socket".
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import ssl
import struct
import threading
import time
from collections.abc import Iterable, Iterator

from services.common.errors import DapoError
from services.common.security import TlsConfig, read_pem

log = logging.getLogger(__name__)

TICKET_BYTES = 32
FRAME = struct.Struct("<Q")
RECV_CHUNK = 4 << 20  # bytes per recv_into call
CONNECTION_THREAD = "weight-socket-connection"  # each connection's thread (tests count them)
LINGER_S = 10.0  # after the last frame, how long we wait for the client to close
# A reader that takes no whole frame (one bucket, 4 MiB by default) in this long is
# dropped: a frozen rollout server (SIGSTOP, a partition) must not hold a slot for the
# whole transfer deadline.
FRAME_TIMEOUT_S = 60.0
MAX_TICKETS = 1024  # outstanding at once: a flood of OpenWeightSocket calls stays bounded
COALESCE_BYTES = 64 << 10  # frame parts smaller than this are joined before sending
IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024)  # buffers per sendmsg call

# One frame as parts (bytes, or 1-D byte views) that join to one serialized WeightBucket,
# its length prefix excluded.
Frame = list[bytes | memoryview]


class WeightSocketError(DapoError):
    """The weight socket refused us, broke off, or sent a frame we will not take."""


class TooManyTickets(WeightSocketError):
    """MAX_TICKETS are outstanding (issued, neither redeemed nor expired)."""


# ------------------------------------------------------------------------------ TLS
def server_context(tls: TlsConfig) -> ssl.SSLContext | None:
    """The server side of TLS (client certs required under mTLS); None when TLS is off."""
    if not tls.enabled:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(_existing(tls.cert, "cert"), _existing(tls.key, "key"))
    if tls.mtls:
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(cadata=read_pem(tls.ca, "ca").decode())
    return context


def client_context(tls: TlsConfig) -> ssl.SSLContext | None:
    """The client side of TLS: the server checked against `tls.ca` (system roots if
    unset), our cert presented under mTLS; None when TLS is off."""
    if not tls.enabled:
        return None
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    if tls.ca is not None:
        context.load_verify_locations(cadata=read_pem(tls.ca, "ca").decode())
    if tls.mtls:
        context.load_cert_chain(_existing(tls.cert, "cert"), _existing(tls.key, "key"))
    return context


def _existing(path: str | None, what: str) -> str:
    read_pem(path, what)  # the same clear error as gRPC's credentials when missing
    return str(path)


# ------------------------------------------------------------------------------ server
class WeightSocketServer:
    """Serves ticketed frame lists; one thread per connection, at most `max_connections`."""

    def __init__(
        self,
        host: str,
        port: int,
        tls: TlsConfig,
        ticket_ttl_s: float = 60.0,
        io_timeout_s: float = 600.0,
        max_connections: int = 16,
        frame_timeout_s: float = FRAME_TIMEOUT_S,
    ) -> None:
        self.ticket_ttl_s = ticket_ttl_s
        self.frame_timeout_s = min(io_timeout_s, frame_timeout_s)
        self._context = server_context(tls)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family)
        self.port: int = self._listener.getsockname()[1]
        self._tickets: dict[bytes, tuple[float, Iterable[Frame]]] = {}
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(max_connections)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="weight-socket", daemon=True)

    def start(self) -> WeightSocketServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        close_listener(self._listener, self._thread)

    def issue(self, frames: Iterable[Frame]) -> bytes:
        """A ticket for one stream of `frames` (kept alive by the ticket until used)."""
        ticket = secrets.token_bytes(TICKET_BYTES)
        self.purge()
        with self._lock:
            if len(self._tickets) >= MAX_TICKETS:
                raise TooManyTickets(f"{MAX_TICKETS} weight socket tickets are outstanding")
            self._tickets[ticket] = (time.monotonic() + self.ticket_ttl_s, frames)
        return ticket

    def purge(self) -> None:
        """Forget expired tickets: each holds its version's frames, and so the snapshot
        they view, until it is redeemed or forgotten (the learner purges on publish too)."""
        now = time.monotonic()
        with self._lock:
            self._tickets = {t: v for t, v in self._tickets.items() if v[0] > now}

    def _redeem(self, ticket: bytes) -> Iterable[Frame] | None:
        with self._lock:
            entry = self._tickets.pop(ticket, None)
        if entry is None or entry[0] < time.monotonic():
            return None
        return entry[1]

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                conn, peer = self._listener.accept()
            except OSError:
                return  # closed by stop()
            if not self._slots.acquire(blocking=False):
                log.warning("weight socket: too many connections, refusing %s", peer)
                conn.close()
                continue
            threading.Thread(
                target=self._serve, args=(conn, peer), name=CONNECTION_THREAD, daemon=True
            ).start()

    def _serve(self, conn: socket.socket, peer: object) -> None:
        try:
            conn.settimeout(10.0)  # handshake and ticket: a silent peer holds no slot long
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # the end marker too
            if self._context is not None:
                conn = self._context.wrap_socket(conn, server_side=True)
            frames = self._redeem(recv_exact(conn, TICKET_BYTES))
            if frames is None:
                log.warning("weight socket: bad, used or expired ticket from %s", peer)
                return
            conn.settimeout(self.frame_timeout_s)  # per send call: a frozen reader times out
            for frame in frames:
                send_frame(conn, frame)
            conn.sendall(FRAME.pack(0))
            linger(conn)
        except (OSError, WeightSocketError) as exc:  # ssl.SSLError is an OSError
            log.info("weight socket: connection from %s ended: %s", peer, exc)
        finally:
            conn.close()
            self._slots.release()


def send_frame(conn: socket.socket, parts: Frame) -> None:
    """One frame: its length, then its parts, without copying the large ones. Runs of
    small parts (the protobuf metadata around each slice's data) are joined first: a
    dozen tiny writes per frame would each wait on the peer's delayed ACK. A plain socket
    takes the frame in one scatter/gather `sendmsg` (repeated after a partial send); TLS
    (`ssl.SSLSocket` has no sendmsg) takes one `sendall` per joined part."""
    chunks = coalesce([FRAME.pack(sum(len(p) for p in parts)), *parts])
    if isinstance(conn, ssl.SSLSocket):
        for chunk in chunks:
            conn.sendall(chunk)
        return
    views = [memoryview(c).cast("B") for c in chunks if len(c)]
    at = 0
    while at < len(views):
        sent = conn.sendmsg(views[at : at + IOV_MAX])
        while at < len(views) and sent >= len(views[at]):
            sent -= len(views[at])
            at += 1
        if sent:  # a partial send stopped inside this view
            views[at] = views[at][sent:]


def coalesce(parts: list[bytes | memoryview]) -> Frame:
    """`parts` with each run of parts under COALESCE_BYTES joined into one `bytes`."""
    out: Frame = []
    small: Frame = []
    for part in parts:
        if len(part) < COALESCE_BYTES:
            small.append(part)
            continue
        if small:
            out.append(b"".join(small))
            small = []
        out.append(part)
    if small:
        out.append(b"".join(small))
    return out


def linger(conn: socket.socket) -> None:
    """Half-close, then read until the client closes (or LINGER_S): closing a socket that
    holds unread input (bytes sent after the ticket) makes the kernel send RST and drop
    the frames still queued for sending, cutting the stream short."""
    conn.shutdown(socket.SHUT_WR)  # under TLS: a plain FIN after the last frame
    deadline = time.monotonic() + LINGER_S
    while (left := deadline - time.monotonic()) > 0:
        conn.settimeout(left)
        if not conn.recv(1 << 16):
            return


# ------------------------------------------------------------------------------ client
def recv_exact(sock: socket.socket, n: int, into: memoryview | None = None) -> bytes:
    """Exactly `n` bytes (into `into` when given, returning b"")."""
    view = into if into is not None else memoryview(bytearray(n))
    got = 0
    while got < n:
        read = sock.recv_into(view[got:n], min(n - got, RECV_CHUNK))
        if not read:
            raise WeightSocketError(
                f"weight socket closed after {got} of {n} bytes (ticket refused or expired, "
                "or the learner went away)"
            )
        got += read
    return b"" if into is not None else bytes(view)


def close_listener(listener: socket.socket, acceptor: threading.Thread) -> None:
    """Wake the thread blocked in `accept` (shutdown), close the socket, join the thread."""
    try:
        listener.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    listener.close()
    acceptor.join(timeout=5)


def connect(host: str, port: int, ticket: bytes, tls: TlsConfig, timeout_s: float) -> socket.socket:
    """A connected socket that has sent its ticket (TLS as configured)."""
    sock = socket.create_connection((host, port), timeout=min(timeout_s, 10.0))
    try:
        context = client_context(tls)
        if context is not None:
            sock = context.wrap_socket(sock, server_hostname=tls.server_name or host)
        sock.settimeout(timeout_s)
        sock.sendall(ticket)
    except BaseException:
        sock.close()
        raise
    return sock


def read_frames(sock: socket.socket, max_frame_bytes: int) -> Iterator[memoryview]:
    """The frames of one stream, each a view into one reused buffer: a view is valid
    only until the next one is taken (consume it first). Closes `sock` at the end.
    (Rollout servers receive in place instead: services/weight_transport/frame_reader.py.)"""
    buf = bytearray()
    try:
        while size := frame_size(sock, max_frame_bytes):
            if size > len(buf):
                buf = bytearray(size)
            view = memoryview(buf)[:size]
            recv_exact(sock, size, view)
            yield view
    except OSError as exc:  # a reset, a timeout, a TLS alert (e.g. our cert refused)
        raise WeightSocketError(f"weight socket failed: {exc}") from exc
    finally:
        sock.close()


def frame_size(sock: socket.socket, max_frame_bytes: int) -> int:
    """The next frame's length (0: the stream's end), refused before its bytes are read
    when over `max_frame_bytes`."""
    header = bytearray(FRAME.size)
    recv_exact(sock, FRAME.size, memoryview(header))
    (size,) = FRAME.unpack(header)
    if size > max_frame_bytes:
        raise WeightSocketError(
            f"weight socket frame of {size} bytes exceeds the limit of "
            f"{max_frame_bytes} (shared.rpc.max_message_bytes)"
        )
    return size
