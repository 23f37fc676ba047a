"""One way every role starts: `python -m <role>` and `dapo <role>` parse the same flags,
resolve the same config (validated by the role's own settings model) and call the role's
`run(settings)`; bad input exits 2 with a one-line message, never a traceback."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn, TypeVar

from services.common.arg_types import redis_url
from services.common.config_loader import load_settings
from services.common.errors import DapoError
from services.common.presets import PRESETS
from services.common.settings import RoleSettings

S = TypeVar("S", bound=RoleSettings)


class Parser(argparse.ArgumentParser):
    """argparse with bad flags reported in one line (usage on `--help`), like every other
    bad input of the `dapo` commands."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="F", help="YAML or TOML config file")
    parser.add_argument("--preset", help=f"start from a named preset ({', '.join(PRESETS)})")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="override one config value (repeatable)",
    )


def add_redis_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--redis-url", type=redis_url, help="Redis URL, e.g. redis://127.0.0.1:6379/0"
    )


def add_service_args(parser: argparse.ArgumentParser) -> None:
    add_config_args(parser)
    add_redis_arg(parser)
    parser.add_argument("--grpc-port", type=int, help="gRPC port (0 = pick a free one)")
    parser.add_argument("--http-port", type=int, help="HTTP port (0 = pick a free one)")


def flag_overrides(args: argparse.Namespace, section: str | None) -> list[str]:
    """The `--set` overrides plus what `--redis-url`, `--grpc-port` and `--http-port` mean."""
    overrides = list(args.overrides)
    if getattr(args, "redis_url", None):  # probe-ok: argparse; not every command has it
        overrides.append(f"shared.redis_url={args.redis_url}")
    for flag in ("grpc_port", "http_port"):
        value = getattr(args, flag, None)  # probe-ok: argparse; not every command has it
        if value is not None and section is not None:
            overrides.append(f"{section}.server.{flag}={value}")
    return overrides


def role_parser(role: str, description: str) -> argparse.ArgumentParser:
    parser = Parser(prog=f"dapo {role}", description=description)
    add_service_args(parser)
    return parser


def role_main(
    role: str,
    settings_type: type[S],
    run: Callable[[S], None],
    argv: Sequence[str] | None = None,
    *,
    description: str,
    needs_redis: bool,
) -> int:
    """Parse the flags, resolve `settings_type`, set up logging and run the role."""
    args = role_parser(role, description).parse_args(argv)
    try:
        settings = load_settings(
            settings_type, args.config, preset=args.preset, overrides=flag_overrides(args, role)
        )
        if needs_redis and not settings.shared.redis_url:
            raise DapoError(f"{role} needs Redis: pass --redis-url or set shared.redis_url")
        from services.common.lifecycle import exit_with_parent
        from services.common.logs import setup_logging

        setup_logging(role)
        exit_with_parent()
        run(settings)
    except DapoError as exc:
        print(f"dapo {role}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0
