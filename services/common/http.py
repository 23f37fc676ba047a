"""The HTTP side every service shares: /healthz, /readyz, /metrics, /status on FastAPI.

`serve_http` runs uvicorn in a background thread so a service's main thread stays free
for its gRPC server or its stream loop.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import uvicorn
from fastapi import Depends, FastAPI, HTTPException, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest

from services.common.errors import DapoError, PortInUseError
from services.common.security import AuthConfig, bearer_ok


def create_http_app(
    name: str,
    *,
    ready: Callable[[], bool] = lambda: True,
    status: Callable[[], dict[str, Any]] = dict,
    registry: CollectorRegistry = REGISTRY,
    auth: AuthConfig | None = None,
) -> FastAPI:
    """A FastAPI app with the four standard endpoints; services add their own routes.

    With a token configured, /status (and /metrics if `auth.protect_metrics`) answer 401
    without `Authorization: Bearer <token>`; /healthz and /readyz stay open for probes.
    """
    app = FastAPI(title=f"dapo {name}")
    guard = token_guard(auth)
    metrics_guard = guard if auth is not None and auth.protect_metrics else []

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok", "service": name}

    @app.get("/readyz")
    def readyz(response: Response) -> dict[str, Any]:
        ok = bool(ready())
        response.status_code = 200 if ok else 503
        return {"ready": ok, "service": name}

    @app.get("/metrics", dependencies=metrics_guard)
    def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/status", dependencies=guard)
    def get_status() -> dict[str, Any]:
        return {"service": name, **status()}

    return app


def token_guard(auth: AuthConfig | None) -> list[Any]:
    """Route dependencies that demand the bearer token (none when auth is off)."""
    token = auth.secret() if auth is not None else None
    if token is None:
        return []

    def require_token(request: Request) -> None:
        if not bearer_ok(request.headers.get("authorization"), token):
            raise HTTPException(
                401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"}
            )

    return [Depends(require_token)]


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind a listening TCP socket (port 0 = any free port), or fail naming the port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise PortInUseError(f"cannot bind {host}:{port}: {exc.strerror}") from None
    # Accepted connections inherit this. uvicorn on a pre-bound socket leaves Nagle on,
    # and Nagle plus the client's delayed ACK held every keep-alive response ~40 ms.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.listen(128)
    return sock


class HttpServer:
    """uvicorn on a pre-bound socket, in a daemon thread."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> None:
        self._sock = bind_socket(host, port)
        self.host = host
        self.port: int = self._sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )

    def start(self, timeout_s: float = 10.0) -> HttpServer:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise DapoError(f"HTTP server on port {self.port} did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=5)
        self._sock.close()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def serve_http(app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> HttpServer:
    """Start `app` and return once it accepts connections."""
    return HttpServer(app, host, port).start()
