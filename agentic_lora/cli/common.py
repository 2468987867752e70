"""What every ``agentic-lora`` command shares: exit codes, the one-line error parser, the
CLI's own environment variables and the admin client of a running server."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from pydantic_settings import BaseSettings, SettingsConfigDict

from agentic_lora.config import AgenticLoRASettings
from agentic_lora.errors import ConfigurationError

if TYPE_CHECKING:
    from agentic_lora.gateway.client import AdminClient

__all__ = [
    "DEFAULT_SERVER",
    "ENV_PREFIX",
    "EXIT_ERROR",
    "EXIT_NOT_PUBLISHED",
    "EXIT_OK",
    "EXIT_USAGE",
    "CliEnvironment",
    "Parser",
    "UsageError",
    "absolute_path",
    "add_admin_token_arguments",
    "add_client_arguments",
    "admin_client",
    "admin_token",
    "one_line",
]

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_NOT_PUBLISHED = 3

DEFAULT_SERVER = "http://127.0.0.1:8000"

#: The settings' environment prefix; the CLI's own variables share it.
ENV_PREFIX: str = AgenticLoRASettings.model_config.get("env_prefix", "")


class CliEnvironment(BaseSettings):
    """The CLI's own environment variables (``AGENTIC_LORA_SERVER``, ``..._ADMIN_TOKEN``,
    ``..._CONFIG``), read when a command runs."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")

    server: str | None = None
    admin_token: str | None = None
    config: str | None = None


class UsageError(Exception):
    """A command line argparse could not accept."""


class Parser(argparse.ArgumentParser):
    # argparse prints usage and exits on a bad command line; the CLI answers with one line.
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message}")


def one_line(text: str) -> str:
    return " ".join(str(text).split())


def absolute_path(value: str) -> str:
    # The gateway resolves nothing: it reads exactly the path it is given.
    return os.path.abspath(os.path.expanduser(value))


def _read_token_file(path: str) -> str:
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ConfigurationError(
            f"admin token file {path} cannot be read ({exc.strerror or exc})",
            check="admin_token",
        ) from exc
    if not token:
        raise ConfigurationError(f"admin token file {path} is empty", check="admin_token")
    return token


def admin_token(args: argparse.Namespace, token_file: str | None = None) -> str | None:
    """The environment's token, else ``--admin-token-file``'s, else the config file's.

    A token given on the command line (``--admin-token``, kept only to say so) is refused:
    every user of the host sees a command line (``ps``).
    """
    if getattr(args, "admin_token", None):
        raise ConfigurationError(
            "--admin-token puts the token on the command line, where every user of the host "
            f"sees it: use --admin-token-file PATH or ${ENV_PREFIX}ADMIN_TOKEN",
            check="admin_token",
        )
    from_env = CliEnvironment().admin_token
    if from_env:
        return from_env
    path = getattr(args, "admin_token_file", None) or token_file
    return _read_token_file(path) if path else None


def admin_client(args: argparse.Namespace) -> AdminClient:
    """The admin API client of the server ``--server`` (or the environment) names."""
    from agentic_lora.gateway.client import AdminClient

    server = args.server or CliEnvironment().server or DEFAULT_SERVER
    return AdminClient(server, token=admin_token(args))


def add_client_arguments(parser: argparse.ArgumentParser) -> None:
    """``--server`` and the admin token: every command that talks to a running server."""
    parser.add_argument(
        "--server", help=f"gateway base URL (env {ENV_PREFIX}SERVER; default {DEFAULT_SERVER})"
    )
    add_admin_token_arguments(parser)


def add_admin_token_arguments(parser: argparse.ArgumentParser) -> None:
    """``--admin-token-file`` (and the refused ``--admin-token``, hidden from the help)."""
    parser.add_argument(
        "--admin-token-file",
        help=f"file holding the admin token (else ${ENV_PREFIX}ADMIN_TOKEN)",
    )
    parser.add_argument("--admin-token", help=argparse.SUPPRESS)
