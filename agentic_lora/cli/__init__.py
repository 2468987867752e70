"""The ``agentic-lora`` command line: one thin module per command, each declaring itself once as
its ``COMMAND`` (:class:`~agentic_lora.cli.common.Command`: name, what it reads, handler,
arguments, help), registered from the one table :data:`agentic_lora.cli.main.COMMANDS`.

::

    agentic-lora serve   --config agentic-lora.toml          registry + publisher + reclaimer + gateway
    agentic-lora publish ADAPTER_DIR --version-id ID         progress per engine and phase, then the outcome
    agentic-lora status  [--json] [--journal PATH]           versions, Session refs, per-engine readiness
    agentic-lora reclaim [--json]                            one reclaim round now
    agentic-lora resolve [VERSION] [--json]                  finish blocked publications now
    agentic-lora rollback VERSION [--json]                   make an earlier version the default again
    agentic-lora engines list|add|drain|remove [ENGINE]      engines join, drain and leave at runtime
    agentic-lora doctor  --config agentic-lora.toml          check every engine against the settings

The registry lives in the ``serve`` process, so ``publish``, ``status``, ``reclaim``,
``resolve``, ``rollback`` and ``engines`` talk to it over the gateway's admin API (``--server``, ``--admin-token-file``; or
``AGENTIC_LORA_SERVER`` and ``AGENTIC_LORA_ADMIN_TOKEN``: a token never goes on a command line). ``status --journal PATH`` reads a
journaled registry without a server, from a consistent copy, never writing to the journal.

Settings come from, strongest first: command-line flags, ``AGENTIC_LORA_*`` environment
variables, the config file (TOML or JSON), defaults (:mod:`agentic_lora.cli.config_file`).
Every failure prints one line, ``error: CODE: message``, with a stable code from
:mod:`agentic_lora.errors`, and exits non-zero: 1 for an error, 2 for a bad command line, 3 when
a publication was skipped (no free capacity slot; nothing changed). ``--debug`` adds the
traceback.

The server runner itself is :func:`agentic_lora.gateway.serve.serve` (``agentic_lora.cli.serve``
is the ``serve`` command's module).
"""

from __future__ import annotations

from agentic_lora.cli.common import EXIT_ERROR
from agentic_lora.cli.common import EXIT_NOT_PUBLISHED
from agentic_lora.cli.common import EXIT_OK
from agentic_lora.cli.common import EXIT_USAGE
from agentic_lora.cli.config_file import ConfigFile
from agentic_lora.cli.config_file import layered_settings
from agentic_lora.cli.config_file import read_config_file
from agentic_lora.cli.doctor import DoctorCheck
from agentic_lora.cli.logs import JsonLogFormatter
from agentic_lora.cli.main import build_parser
from agentic_lora.cli.main import main
from agentic_lora.cli.main import run
from agentic_lora.cli.main import serve_options
from agentic_lora.gateway.serve import DEFAULT_HOST
from agentic_lora.gateway.serve import DEFAULT_PORT
from agentic_lora.gateway.serve import Served
from agentic_lora.gateway.serve import ServeOptions

__all__ = [
    "DEFAULT_HOST",
    "DEFAULT_PORT",
    "EXIT_ERROR",
    "EXIT_NOT_PUBLISHED",
    "EXIT_OK",
    "EXIT_USAGE",
    "ConfigFile",
    "DoctorCheck",
    "JsonLogFormatter",
    "ServeOptions",
    "Served",
    "build_parser",
    "layered_settings",
    "main",
    "read_config_file",
    "run",
    "serve_options",
]
