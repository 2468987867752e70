"""``agentic-lora serve``: registry, publisher, reclaimer and the Session gateway in one server.

This module only resolves the options (config file, environment, flags) and sets up logging;
the server itself is :func:`agentic_lora.gateway.serve.serve`.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Mapping
from collections.abc import Sequence
from typing import IO
from typing import TYPE_CHECKING
from typing import Any

from agentic_lora.cli.common import EXIT_OK
from agentic_lora.cli.common import TOKEN_ARGUMENTS
from agentic_lora.cli.common import Command
from agentic_lora.cli.common import Needs
from agentic_lora.cli.common import admin_token
from agentic_lora.cli.common import argument
from agentic_lora.cli.config_file import ConfigFile
from agentic_lora.cli.config_file import layered_settings
from agentic_lora.cli.config_file import read_config_file
from agentic_lora.cli.logs import configure_logging
from agentic_lora.errors import ConfigurationError
from agentic_lora.gateway.serve import DEFAULT_HOST
from agentic_lora.gateway.serve import DEFAULT_PORT
from agentic_lora.gateway.serve import ServeOptions

if TYPE_CHECKING:
    from agentic_lora.gateway.serve import Served

__all__ = ["COMMAND", "options_from"]

logger = logging.getLogger(__name__)


def _backend_options(config: ConfigFile, given: Sequence[str] | None) -> dict[str, Any]:
    options = dict(config.backend_options)
    for item in given or ():
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigurationError(
                f"--backend-option {item!r} is not KEY=VALUE", check="backend_options"
            )
        options[key.strip()] = value
    return options


def options_from(args: argparse.Namespace) -> ServeOptions:
    """The :class:`~agentic_lora.gateway.serve.ServeOptions` parsed ``serve`` arguments give."""
    config = read_config_file(args.config)
    gw: Mapping[str, Any] = config.gateway
    settings = layered_settings(args, config, fallback={"enable_versioned_lora_publication": True})
    port = args.port if args.port is not None else gw.get("port", DEFAULT_PORT)
    idle = args.idle_timeout if args.idle_timeout is not None else gw.get("idle_timeout")
    if not isinstance(port, int) or not 0 <= port <= 65535:
        raise ConfigurationError(f"port {port!r} is not a TCP port", check="port")
    if idle is not None and (not isinstance(idle, int | float) or idle <= 0):
        raise ConfigurationError(f"idle_timeout {idle!r} must be positive", check="idle_timeout")
    return ServeOptions(
        settings=settings,
        backend_options=_backend_options(config, args.backend_option),
        host=str(args.host or gw.get("host", DEFAULT_HOST)),
        port=port,
        admin_token=admin_token(args, gw.get("admin_token_file")),
        idle_timeout=float(idle) if idle is not None else None,
        reuse_closed_ids=bool(args.reuse_closed_ids or gw.get("reuse_closed_ids", False)),
        access_log=bool(args.access_log or gw.get("access_log", False)),
        verify_engines=not args.skip_engine_check,
    )


async def run(args: argparse.Namespace, out: IO[str]) -> int:
    from agentic_lora.gateway.serve import serve

    options = options_from(args)
    level = logging.getLevelName((args.log_level or "INFO").upper())
    if not isinstance(level, int):
        raise ConfigurationError(f"unknown log level {args.log_level!r}", check="log_level")
    # Until it serves, only problems are logged: a start-up failure stays one error line.
    configure_logging(max(level, logging.WARNING), args.log_format)

    def ready(served: Served) -> None:
        logging.getLogger().setLevel(level)
        logger.info(
            "agentic-lora gateway serving on %s",
            served.url,
            extra={
                "engines": [e.name for e in options.settings.engines],
                "capacity": options.settings.capacity,
            },
        )

    await serve(options, on_ready=ready)
    return EXIT_OK


COMMAND = Command(
    "serve",
    Needs.SETTINGS,
    run,
    arguments=(
        argument("--host", help=f"listen address (default {DEFAULT_HOST})"),
        argument("--port", type=int, help=f"listen port (default {DEFAULT_PORT}; 0: any)"),
        *TOKEN_ARGUMENTS,
        argument(
            "--backend-option",
            action="append",
            metavar="KEY=VALUE",
            help="backend plugin option, e.g. store_root=/srv/adapters (repeatable)",
        ),
        argument(
            "--idle-timeout",
            type=float,
            help="close Sessions idle this many seconds (default: gateway_idle_timeout, 900)",
        ),
        argument(
            "--reuse-closed-ids",
            action="store_true",
            help="let a closed Session id open a new Session (default: refused)",
        ),
        argument("--access-log", action="store_true", help="log every HTTP request"),
        argument(
            "--skip-engine-check",
            action="store_true",
            help="do not check the engines' LoRA settings at start-up",
        ),
        argument("--log-level", help="logging level (default INFO)"),
        argument("--log-format", choices=["text", "json"], default="text", help="log format"),
    ),
    help="run registry, publisher, reclaimer and gateway",
    description="Run the registry, publisher, background reclaimer and the Session gateway.",
)
