"""The one shape of a role's server.

Every role's `create_server(settings)` returns a `Service`: `start()` binds its ports,
starts its threads and registers it; `wait(stop)` blocks until a signal or until the
role's work is done; `stop()` releases everything. `serve(role, service)` is the whole of
a role's process. Every role serves the same HTTP endpoints (/healthz, /readyz,
/metrics, /status: services/common/http.py), exports metrics named `dapo_<role>_*`, and
registers through `register`.
"""

from __future__ import annotations

import logging
import threading
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

import redis

from services.common.http import HttpServer, create_http_app, serve_http
from services.common.keys import RunKeys
from services.common.lifecycle import advertised_address, announce, stop_event_on_signals
from services.common.registry import Registration
from services.common.security import AuthConfig
from services.common.server_config import ServerConfig
from services.common.settings import RoleSettings

log = logging.getLogger(__name__)


class Service(Protocol):
    """What `create_server` returns in every role."""

    @property
    def ports(self) -> dict[str, int]:
        """The bound ports by name (`http`, `grpc`, ...), known after `start()`."""
        ...

    def start(self) -> Service: ...

    def wait(self, stop: threading.Event) -> None: ...

    def stop(self) -> None: ...


@dataclass(frozen=True)
class IdleWhenDone:
    """Where a finished service keeps answering probes (`shared.when_done: idle`)."""

    host: str
    auth: AuthConfig


def idle_when_done(settings: RoleSettings, server: ServerConfig) -> IdleWhenDone | None:
    """The role's HTTP host and auth when the run config asks finished services to idle."""
    if settings.shared.when_done != "idle":
        return None
    return IdleWhenDone(server.host, settings.security.auth)


def serve(role: str, service: Service, idle: IdleWhenDone | None = None) -> None:
    """Start, print the bound ports, wait for a signal (or the end of the run), stop.

    With `idle`, a run that ended (no signal) leaves the process up after `stop()`: it
    holds no engine, port or thread of the role any more and answers /healthz and /readyz
    on the same HTTP port until SIGTERM, so an orchestrator that restarts exited pods
    (Deployment, StatefulSet) sees a finished pod instead of a crash loop."""
    stop = stop_event_on_signals()
    service.start()
    try:
        announce(role, **service.ports)
        http_port = service.ports.get("http", 0)
        service.wait(stop)
    finally:
        service.stop()
    if idle is not None and not stop.is_set():
        idle_until_signal(role, idle, http_port, stop)


def idle_until_signal(role: str, idle: IdleWhenDone, port: int, stop: threading.Event) -> None:
    """Answer the probes on `port` (and /status: the run is done) until `stop` is set."""
    app = create_http_app(role, status=lambda: {"run": "done"}, auth=idle.auth)
    http = serve_http(app, idle.host, port)
    log.info("run done; %s idles on port %d until SIGTERM (shared.when_done=idle)", role, port)
    try:
        stop.wait()
    finally:
        http.stop()


class Worker(Protocol):
    """A role's work as one loop in the calling thread, with a status for /status."""

    def run(self, stop: threading.Event) -> None: ...

    def status(self) -> dict[str, Any]: ...


class LoopServer:
    """A `Service` for a role whose work is one loop (controller, buffer): the shared
    HTTP endpoints around the worker's `run`."""

    def __init__(self, role: str, worker: Worker, server: ServerConfig, auth: AuthConfig):
        self.role, self.worker, self.server, self.auth = role, worker, server, auth
        self.http: HttpServer | None = None

    @property
    def ports(self) -> dict[str, int]:
        return {"http": self.http.port if self.http else 0}

    def start(self) -> LoopServer:
        app = create_http_app(self.role, status=self.worker.status, auth=self.auth)
        self.http = serve_http(app, self.server.host, self.server.http_port)
        return self

    def wait(self, stop: threading.Event) -> None:
        self.worker.run(stop)

    def stop(self) -> None:
        if self.http is not None:
            self.http.stop()


def register(
    client: redis.Redis, settings: RoleSettings, role: str, host: str, port: int, **info: Any
) -> Registration:
    """Announce this instance in the run's registry under the shared TTL, `ready` unless
    `info` says otherwise."""
    return Registration(
        client,
        RunKeys(settings.shared.run_name),
        role,
        f"{role}-{uuid.uuid4().hex[:8]}",
        {"address": advertised_address(host, port), "ready": True, **info},
        ttl_s=settings.shared.registry_ttl_s,
    ).start()


def run_is_done(client: redis.Redis, settings: RoleSettings) -> bool:
    """True once the learner has marked the run finished."""
    return bool(client.exists(RunKeys(settings.shared.run_name).done))
