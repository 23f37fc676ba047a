"""A TLS-terminating proxy in front of a plain redis-server: rediss:// end to end in tests.

The bundled redis-server is built without TLS, so this plays stunnel (or a TLS-enabled
Redis): it does the handshake with a server certificate, optionally requires a client
certificate signed by `client_ca` (mTLS), and pipes bytes both ways to the plain port.
It uses blocking `ssl` sockets, not asyncio: like real TLS servers they send the alert
when they refuse a handshake, where asyncio's TLS closes without one.
"""

from __future__ import annotations

import selectors
import socket
import ssl
import threading
from pathlib import Path

from pki import Issued

POLL_S = 0.05  # how often idle threads look at the stop flag
IO_TIMEOUT_S = 5.0  # a handshake or a half-sent record never blocks a thread longer


def server_context(server: Issued, client_ca: Path | None) -> ssl.SSLContext:
    """A server-side context; with `client_ca`, clients must present a cert it signed."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(server.cert, server.key)
    if client_ca is not None:
        context.load_verify_locations(client_ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def read_available(sock: socket.socket) -> bytes:
    """One read, plus what the TLS layer has already decrypted (select cannot see that)."""
    data = sock.recv(65536)
    while isinstance(sock, ssl.SSLSocket) and sock.pending():
        data += sock.recv(sock.pending())
    return data


def pump(a: socket.socket, b: socket.socket, stop: threading.Event) -> None:
    """Copy bytes both ways until one side closes or `stop` is set."""
    peer = {a: b, b: a}
    with selectors.DefaultSelector() as selector:
        for sock in peer:
            selector.register(sock, selectors.EVENT_READ)
        while not stop.is_set():
            for key, _ in selector.select(POLL_S):
                data = read_available(key.fileobj)  # type: ignore[arg-type]
                if not data:
                    return
                peer[key.fileobj].sendall(data)  # type: ignore[index]


class TlsProxy:
    """Listens on 127.0.0.1 (a free port, or `port`), forwards to 127.0.0.1:`upstream_port`."""

    def __init__(
        self, upstream_port: int, server: Issued, client_ca: Path | None = None, port: int = 0
    ) -> None:
        self.upstream_port = upstream_port
        self.context = server_context(server, client_ca)
        self.refused: list[str] = []  # handshakes this proxy refused, in its own words
        self.served = 0  # connections that completed the handshake
        self._stop = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", port))
        self._listener.settimeout(POLL_S)
        self.port: int = self._listener.getsockname()[1]
        self._threads = [threading.Thread(target=self._accept, name="tls-proxy-accept")]
        self._threads[0].start()

    @property
    def url(self) -> str:
        return f"rediss://127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            thread = threading.Thread(target=self._serve, args=(conn,), name="tls-proxy-conn")
            self._threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(IO_TIMEOUT_S)
        try:
            tls = self.context.wrap_socket(conn, server_side=True)
        except OSError as exc:  # ssl.SSLError included: the alert has been sent
            self.refused.append(str(exc))
            conn.close()
            return
        self.served += 1
        try:
            with tls, socket.create_connection(("127.0.0.1", self.upstream_port)) as plain:
                plain.settimeout(IO_TIMEOUT_S)
                pump(tls, plain, self._stop)
        except OSError:
            pass  # either side went away: the connection ends, as with any TLS proxy

    def stop(self) -> None:
        """Close the port and every connection; join all threads (raise if one hangs)."""
        self._stop.set()
        self._threads[0].join(timeout=IO_TIMEOUT_S + 1)  # no thread is added after this
        self._listener.close()
        for thread in self._threads[1:]:
            thread.join(timeout=IO_TIMEOUT_S + 1)
        alive = [t.name for t in self._threads if t.is_alive()]
        if alive:
            raise RuntimeError(f"TLS proxy threads did not stop: {alive}")

    def __enter__(self) -> TlsProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
