"""The ``agentic-lora`` parser and entry points: one subcommand per module of this package."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence
from typing import IO

from agentic_lora.cli import doctor
from agentic_lora.cli import engines
from agentic_lora.cli import publish
from agentic_lora.cli import reclaim
from agentic_lora.cli import resolve
from agentic_lora.cli import rollback
from agentic_lora.cli import serve
from agentic_lora.cli import status
from agentic_lora.cli.common import ENV_PREFIX
from agentic_lora.cli.common import EXIT_ERROR
from agentic_lora.cli.common import EXIT_USAGE
from agentic_lora.cli.common import SERVER_ARGUMENTS
from agentic_lora.cli.common import CliEnvironment
from agentic_lora.cli.common import Command
from agentic_lora.cli.common import Needs
from agentic_lora.cli.common import Parser
from agentic_lora.cli.common import UsageError
from agentic_lora.cli.common import one_line
from agentic_lora.config import add_arguments
from agentic_lora.errors import AgenticLoRAError
from agentic_lora.errors import ConfigurationError
from agentic_lora.gateway.serve import ServeOptions

__all__ = ["COMMANDS", "build_parser", "main", "run", "serve_options"]

#: Every subcommand, in the order ``agentic-lora --help`` lists them.
COMMANDS: tuple[Command, ...] = (
    serve.COMMAND,
    publish.COMMAND,
    status.COMMAND,
    reclaim.COMMAND,
    resolve.COMMAND,
    rollback.COMMAND,
    engines.COMMAND,
    doctor.COMMAND,
)


def _parents() -> dict[Needs, Parser]:
    server = Parser(add_help=False)
    for arg in SERVER_ARGUMENTS:
        arg.add_to(server)
    settings = Parser(add_help=False)
    settings.add_argument(
        "--config",
        default=CliEnvironment().config,
        help=f"config file, TOML or JSON (env {ENV_PREFIX}CONFIG)",
    )
    add_arguments(settings)
    return {Needs.SERVER: server, Needs.SETTINGS: settings}


def build_parser() -> Parser:
    """The ``agentic-lora`` argument parser (every subcommand)."""
    parser = Parser(
        prog="agentic-lora",
        description="Immutable LoRA versions, Session binding at first generation, safe reclaim.",
    )
    parser.add_argument("--debug", action="store_true", help="print tracebacks of failures")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    parents = _parents()
    for command in COMMANDS:
        command.add_to(sub, parents[command.needs])
    return parser


def serve_options(argv: Sequence[str]) -> ServeOptions:
    """Resolve ``agentic-lora serve`` arguments (``argv`` without ``serve``) to options, as the
    whole command line would (the parser is this module's: the serve command knows only its
    own arguments)."""
    return serve.options_from(build_parser().parse_args(["serve", *argv]))


def _print_error(err: IO[str], exc: BaseException, *, debug: bool) -> None:
    if debug:
        import traceback

        traceback.print_exception(exc, file=err)
    if isinstance(exc, AgenticLoRAError):
        line = f"error: {exc}"
    else:
        line = (
            f"error: {AgenticLoRAError.code}: unexpected {type(exc).__name__}: {exc} "
            "(--debug shows the traceback)"
        )
    err.write(one_line(line) + "\n")
    err.flush()


async def run(
    argv: Sequence[str] | None = None,
    *,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
) -> int:
    """Run one command inside a running event loop; returns the exit code (never raises)."""
    out = stdout if stdout is not None else sys.stdout
    err = stderr if stderr is not None else sys.stderr
    try:
        args = build_parser().parse_args(argv)
    except UsageError as exc:
        err.write(f"error: {ConfigurationError.code}: {one_line(str(exc))}\n")
        return EXIT_USAGE
    if args.command != "serve" and not logging.getLogger().handlers:
        # Client commands print their own one-line errors; library warnings stay quiet.
        logging.getLogger().addHandler(logging.NullHandler())
    try:
        code: int = await args.handler(args, out)
    except Exception as exc:
        _print_error(err, exc, debug=args.debug)
        return EXIT_ERROR
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """The ``agentic-lora`` console script."""
    try:
        return asyncio.run(run(argv))
    except KeyboardInterrupt:
        sys.stderr.write("error: interrupted\n")
        return 130
