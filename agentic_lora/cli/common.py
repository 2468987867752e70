"""What every ``agentic-lora`` command shares: exit codes, the one-line error parser, the
declaration of a command and its arguments, the CLI's own environment variables and the admin
client of a running server."""

from __future__ import annotations

import argparse
import enum
import os
from collections.abc import Awaitable
from collections.abc import Callable
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO
from typing import TYPE_CHECKING
from typing import Any
from typing import NoReturn

from pydantic_settings import BaseSettings
from pydantic_settings import SettingsConfigDict

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
    "JSON",
    "SERVER_ARGUMENTS",
    "TOKEN_ARGUMENTS",
    "Argument",
    "CliEnvironment",
    "Command",
    "Handler",
    "Needs",
    "Parser",
    "UsageError",
    "absolute_path",
    "admin_client",
    "admin_token",
    "argument",
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


@dataclass(frozen=True)
class Argument:
    """One ``add_argument`` call: the name or flags, and argparse's keyword options."""

    names: tuple[str, ...]
    options: Mapping[str, Any]

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(*self.names, **self.options)


def argument(*names: str, **options: Any) -> Argument:
    """An :class:`Argument`, written the way ``add_argument`` is called."""
    return Argument(names, options)


#: ``--json``: the command prints its report as JSON instead of text.
JSON = argument("--json", action="store_true", help="print JSON")

#: ``--admin-token-file`` (and the refused ``--admin-token``, hidden from the help).
TOKEN_ARGUMENTS = (
    argument(
        "--admin-token-file", help=f"file holding the admin token (else ${ENV_PREFIX}ADMIN_TOKEN)"
    ),
    argument("--admin-token", help=argparse.SUPPRESS),
)

#: ``--server`` and the admin token: every command that talks to a running server.
SERVER_ARGUMENTS = (
    argument(
        "--server", help=f"gateway base URL (env {ENV_PREFIX}SERVER; default {DEFAULT_SERVER})"
    ),
    *TOKEN_ARGUMENTS,
)

Handler = Callable[[argparse.Namespace, IO[str]], Awaitable[int]]


class Needs(enum.Enum):
    """What a command reads, so which arguments every command of its kind takes first."""

    #: A running server: ``--server`` and the admin token (:data:`SERVER_ARGUMENTS`).
    SERVER = "server"
    #: The settings: ``--config`` and every framework flag.
    SETTINGS = "settings"


@dataclass(frozen=True)
class Command:
    """One ``agentic-lora`` subcommand, as ``--help`` shows it and as it runs."""

    name: str
    needs: Needs
    run: Handler
    arguments: tuple[Argument, ...]
    help: str
    description: str

    def add_to(self, sub: Any, parent: argparse.ArgumentParser) -> None:
        """Add this command to ``sub`` (``add_subparsers``), after ``parent``'s arguments."""
        parser = sub.add_parser(
            self.name, parents=[parent], help=self.help, description=self.description
        )
        for arg in self.arguments:
            arg.add_to(parser)
        parser.set_defaults(handler=self.run)
