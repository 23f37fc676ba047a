"""Security settings every process shares: gRPC TLS/mTLS, a bearer token, Redis auth/TLS.

One `security` section of the config serves all services (docs/security.md). Everything is
off by default, so a laptop run needs no certificates. Secrets (`auth.token`,
`redis.password`) are `SecretStr`: repr, logs and `dapo config` show `**********`; the
launcher hands them to its children through the environment, never through the run's
config file. Torch-free and grpc-free: only the models and pure helpers live here.
"""

from __future__ import annotations

import hmac
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import Field, SecretStr, field_validator, model_validator

from services.common.errors import DapoError
from services.common.server_config import StrictModel

# Control RPCs and RPCs that reveal run data: a bearer token guards them (scope "admin").
ADMIN_RPCS = frozenset(
    {
        "/dapo.v1.RolloutService/GetStatus",
        "/dapo.v1.WeightService/FetchWeights",
        "/dapo.v1.WeightService/OpenWeightSocket",  # its ticket reads the weights
    }
)
HEALTH_PREFIX = "/grpc.health.v1.Health/"
# Leaf names the environment gives verbatim (no YAML parsing): secrets, URLs with passwords.
VERBATIM_FIELDS = frozenset({"token", "password", "redis_url"})
TOKEN_ENV = "DAPO_SECURITY__AUTH__TOKEN"
REDIS_PASSWORD_ENV = "DAPO_SECURITY__REDIS__PASSWORD"
REDIS_URL_ENV = "DAPO_SHARED__REDIS_URL"


class SecurityError(DapoError):
    """A security setting cannot be used (missing file, missing field)."""


def read_secret_file(path: str, what: str) -> str:
    """A secret from a file (a mounted k8s/compose secret), trailing newline stripped."""
    try:
        return Path(path).read_text().strip()
    except OSError as exc:
        raise SecurityError(f"cannot read {what} from {path}: {exc.strerror}") from None


def read_pem(path: str | None, what: str, section: str = "tls") -> bytes:
    """PEM bytes of a certificate/key file, or an error naming the config field."""
    if path is None:
        raise SecurityError(f"security.{section}.{what} must be set when TLS is on")
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise SecurityError(
            f"cannot read security.{section}.{what} {path}: {exc.strerror}"
        ) from None


class _Secret(StrictModel):
    """Coerces YAML scalars (a numeric token) to text before SecretStr sees them."""

    @field_validator("*", mode="before")
    @classmethod
    def _text(cls, value: object) -> object:
        return (
            str(value) if isinstance(value, int | float) and not isinstance(value, bool) else value
        )


class TlsConfig(StrictModel):
    """gRPC transport security for every server and client channel."""

    enabled: bool = Field(False, description="Serve and dial gRPC over TLS.")
    cert: str | None = Field(
        None,
        description="PEM certificate (chain) of this process: server cert, and the "
        "client cert under mTLS.",
    )
    key: str | None = Field(None, description="PEM private key matching `cert`.")
    ca: str | None = Field(
        None, description="PEM CA bundle that signed the peers; None = system roots (clients)."
    )
    mtls: bool = Field(False, description="Servers require client certificates signed by `ca`.")
    server_name: str | None = Field(
        None,
        description="Name to verify in server certificates instead of the dialled host "
        "(one shared name for pods whose addresses are IPs).",
    )

    @model_validator(mode="after")
    def _mtls_needs_ca(self) -> TlsConfig:
        if self.enabled and self.mtls and self.ca is None:
            raise ValueError("tls.mtls needs tls.ca (the CA that signs client certificates)")
        return self


class AuthConfig(_Secret):
    """A bearer token on control RPCs and run-data endpoints; off when no token is set."""

    token: SecretStr | None = Field(
        None, description="The shared token (prefer token_file or DAPO_SECURITY__AUTH__TOKEN)."
    )
    token_file: str | None = Field(None, description="File holding the token (a mounted secret).")
    scope: Literal["admin", "all"] = Field(
        "admin",
        description="admin: the rollout's GetStatus, the learner's weight RPCs "
        "(FetchWeights, OpenWeightSocket) and HTTP /status; all: every RPC but health, and "
        "POST /v1/score too.",
    )
    protect_metrics: bool = Field(False, description="Also require the token on /metrics.")

    def secret(self) -> str | None:
        """The token (file wins over inline), or None when auth is off."""
        if self.token_file is not None:
            return read_secret_file(self.token_file, "security.auth.token_file")
        return self.token.get_secret_value() if self.token is not None else None

    def guards_rpc(self, method: str) -> bool:
        """Whether gRPC `method` (/package.Service/Method) needs the token."""
        if method.startswith(HEALTH_PREFIX):
            return False
        return self.scope == "all" or method in ADMIN_RPCS


class RedisAuthConfig(_Secret):
    """Credentials and TLS files for Redis (`rediss://` URLs use TLS)."""

    username: str | None = Field(None, description="ACL user; None = `default`.")
    password: SecretStr | None = Field(
        None,
        description="Password (or DAPO_SECURITY__REDIS__PASSWORD); `dapo up` starts its "
        "own redis-server with --requirepass it.",
    )
    password_file: str | None = Field(None, description="File holding the password.")
    ca: str | None = Field(None, description="PEM CA for rediss:// (None = system roots).")
    cert: str | None = Field(None, description="PEM client certificate for rediss:// (mTLS).")
    key: str | None = Field(None, description="PEM client key for rediss:// (mTLS).")

    def secret(self) -> str | None:
        if self.password_file is not None:
            return read_secret_file(self.password_file, "security.redis.password_file")
        return self.password.get_secret_value() if self.password is not None else None


class SecurityConfig(StrictModel):
    """The one security block every service reads (docs/security.md)."""

    tls: TlsConfig = Field(default_factory=TlsConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    redis: RedisAuthConfig = Field(default_factory=RedisAuthConfig)


def bearer_ok(header: str | None, token: str) -> bool:
    """`Bearer <token>` matches, compared in constant time."""
    scheme, _, given = (header or "").partition(" ")
    ok = hmac.compare_digest(given.strip().encode(), token.encode())
    return ok and scheme.lower() == "bearer"


def redact_url(url: str) -> str:
    """The URL with any password replaced by `***` (safe to log)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def secret_env(security: SecurityConfig, redis_url: str | None = None) -> dict[str, str]:
    """Inline secrets (and a Redis URL holding a password) as environment variables.

    For child processes: the config file they read has these masked.
    """
    env = {}
    if redis_url is not None and redact_url(redis_url) != redis_url:
        env[REDIS_URL_ENV] = redis_url
    if security.auth.token is not None:
        env[TOKEN_ENV] = security.auth.token.get_secret_value()
    if security.redis.password is not None:
        env[REDIS_PASSWORD_ENV] = security.redis.password.get_secret_value()
    return env


def without_secrets(security: SecurityConfig) -> SecurityConfig:
    """A copy with inline secrets removed (what may be written to a config file)."""
    return security.model_copy(
        update={
            "auth": security.auth.model_copy(update={"token": None}),
            "redis": security.redis.model_copy(update={"password": None}),
        }
    )
