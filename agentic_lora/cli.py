"""The ``agentic-lora`` command line.

::

    agentic-lora serve   --config agentic-lora.toml          registry + publisher + reclaimer + gateway
    agentic-lora publish ADAPTER_DIR --version-id ID         progress per engine and phase, then the outcome
    agentic-lora status  [--json] [--journal PATH]           versions, Session refs, per-engine readiness
    agentic-lora reclaim [--json]                            one reclaim round now
    agentic-lora resolve [VERSION] [--json]                  finish blocked publications now
    agentic-lora doctor  --config agentic-lora.toml          check every engine against the settings
    agentic-lora demo    [ARGS ...]                          run examples/demo.py

The registry lives in the ``serve`` process, so ``publish``, ``status``, ``reclaim`` and
``resolve`` talk to it over the gateway's admin API (``--server``, ``--admin-token``; or
``AGENTIC_LORA_SERVER`` and ``AGENTIC_LORA_ADMIN_TOKEN``). ``status --journal PATH`` reads a
journaled registry without a server, from a consistent copy, never writing to the journal.

Settings come from, strongest first: command-line flags, ``AGENTIC_LORA_*`` environment
variables, the config file (TOML or JSON), defaults. Every failure prints one line,
``error: CODE: message``, with a stable code from :mod:`agentic_lora.errors`, and exits non-zero:
1 for an error, 2 for a bad command line, 3 when a publication was skipped (no free capacity
slot; nothing changed). ``--debug`` adds the traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sqlite3
import sys
import tempfile
import tomllib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Literal, NoReturn

import httpx

from agentic_lora.adapter import AdapterSnapshot
from agentic_lora.backends import EngineRef
from agentic_lora.config import AgenticLoRASettings, add_arguments, from_args, verify_fleet
from agentic_lora.engine_admin import AdminTimeouts, EngineAdminClient
from agentic_lora.errors import (
    AgenticLoRAError,
    BackendAmbiguousError,
    BackendError,
    BackendRefusedError,
    ConfigurationError,
    JournalForeignError,
)
from agentic_lora.registry.types import RegistryStatus

if TYPE_CHECKING:
    from agentic_lora.gateway.app import Gateway

__all__ = [
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
    "main",
    "read_config_file",
    "run",
    "serve",
    "serve_options",
]

logger = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_NOT_PUBLISHED = 3

DEFAULT_SERVER = "http://127.0.0.1:8000"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
_ENV_PREFIX = "AGENTIC_LORA_"
_DIGEST_SHOWN = 12


class _UsageError(Exception):
    """A command line argparse could not accept."""


class _Parser(argparse.ArgumentParser):
    # argparse prints usage and exits on a bad command line; the CLI answers with one line.
    def error(self, message: str) -> NoReturn:
        raise _UsageError(f"{self.prog}: {message}")


# --- config file --------------------------------------------------------------------------------

_GATEWAY_KEYS = frozenset(
    {"host", "port", "admin_token_file", "idle_timeout", "reuse_closed_ids", "access_log"}
)
# Paths in the file are relative to the file, not to wherever the command runs.
_PATH_SETTINGS = frozenset({"journal_path"})
_PATH_BACKEND_OPTIONS = frozenset({"store_root"})
_PATH_GATEWAY = frozenset({"admin_token_file"})


@dataclass(frozen=True)
class ConfigFile:
    """A parsed config file: settings at the top level, plus two tables.

    ``[gateway]`` holds ``host``, ``port``, ``admin_token_file``, ``idle_timeout``,
    ``reuse_closed_ids`` and ``access_log``; ``[backend_options]`` is passed to the backend
    plugin (``store_root`` for HTTP push). Every other key is an
    :class:`~agentic_lora.config.AgenticLoRASettings` field.
    """

    settings: Mapping[str, Any] = field(default_factory=dict)
    gateway: Mapping[str, Any] = field(default_factory=dict)
    backend_options: Mapping[str, Any] = field(default_factory=dict)
    path: Path | None = None


def _config_error(path: Path, message: str) -> ConfigurationError:
    return ConfigurationError(f"config file {path}: {message}", check="config_file", path=str(path))


def _table(path: Path, raw: Mapping[str, Any], key: str) -> dict[str, Any]:
    value = raw.get(key, {})
    if not isinstance(value, Mapping):
        raise _config_error(path, f"`{key}` must be a table/object")
    return dict(value)


def _relative_to(base: Path, values: dict[str, Any], keys: frozenset[str]) -> None:
    for key in keys & values.keys():
        if isinstance(values[key], str) and not Path(values[key]).is_absolute():
            values[key] = str(base / values[key])


def read_config_file(path: str | os.PathLike[str] | None) -> ConfigFile:
    """Read a TOML (``.toml``) or JSON (``.json``) config file; None gives an empty one."""
    if path is None:
        return ConfigFile()
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise _config_error(p, f"cannot be read ({exc.strerror or exc})") from exc
    try:
        if p.suffix == ".toml":
            raw: Any = tomllib.loads(text)
        elif p.suffix == ".json":
            raw = json.loads(text)
        else:
            raise _config_error(p, "must end in .toml or .json")
    except tomllib.TOMLDecodeError as exc:
        raise _config_error(p, f"is not valid TOML: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise _config_error(p, f"is not valid JSON: {exc}") from exc
    if not isinstance(raw, Mapping):
        raise _config_error(p, "must hold a table/object at the top level")
    gateway = _table(p, raw, "gateway")
    unknown = sorted(gateway.keys() - _GATEWAY_KEYS)
    if unknown:
        raise _config_error(
            p, f"unknown [gateway] key(s) {unknown}; known: {sorted(_GATEWAY_KEYS)}"
        )
    backend_options = _table(p, raw, "backend_options")
    settings = {k: v for k, v in raw.items() if k not in ("gateway", "backend_options")}
    base = p.resolve().parent
    _relative_to(base, settings, _PATH_SETTINGS)
    _relative_to(base, backend_options, _PATH_BACKEND_OPTIONS)
    _relative_to(base, gateway, _PATH_GATEWAY)
    return ConfigFile(settings, gateway, backend_options, p)


def _in_environment(field_name: str) -> bool:
    wanted = (_ENV_PREFIX + field_name).upper()
    return any(name.upper() == wanted for name in os.environ)


def _flagged(args: argparse.Namespace, field_name: str) -> bool:
    if field_name == "enable_versioned_lora_publication":
        return getattr(args, field_name, None) is not None
    return getattr(args, "versioned_lora_" + field_name, None) is not None


def _settings(
    args: argparse.Namespace, config: ConfigFile, *, enable: bool | None = True
) -> AgenticLoRASettings:
    """Flags over environment over file over defaults.

    ``enable``: the value of the feature flag when none of the three sets it (None: leave the
    default); ``False`` forces it off (a relaxed load that only checks the fleet list).
    """
    values = {
        k: v for k, v in config.settings.items() if not _flagged(args, k) and not _in_environment(k)
    }
    flag = "enable_versioned_lora_publication"
    if enable is False:
        values[flag] = False
    elif enable and not (
        flag in values or _flagged(args, flag) or _in_environment(flag) or flag in config.settings
    ):
        values[flag] = True
    return from_args(args, **values)


# --- logging ------------------------------------------------------------------------------------

# Standard LogRecord attributes, plus uvicorn's terminal-colour copy of its message.
_RECORD_FIELDS = frozenset(vars(logging.makeLogRecord({})).keys()) | {
    "message",
    "asctime",
    "color_message",
}


class JsonLogFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, and every ``extra=`` key.

    The project logs with stable extra keys (``session``, ``version``, ``engine``, ``attempt``,
    ...), so each line can be filtered by them without parsing the message.
    """

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _RECORD_FIELDS and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, separators=(",", ":"))


def _configure_logging(level: int, fmt: Literal["text", "json"]) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        JsonLogFormatter()
        if fmt == "json"
        else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


# --- serve --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServeOptions:
    """Everything ``agentic-lora serve`` runs with, resolved from file, environment and flags."""

    settings: AgenticLoRASettings
    backend_options: Mapping[str, Any] = field(default_factory=dict)
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    admin_token: str | None = None
    idle_timeout: float | None = None
    reuse_closed_ids: bool = False
    access_log: bool = False
    verify_engines: bool = True


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


def _admin_token(args: argparse.Namespace, token_file: str | None = None) -> str | None:
    if getattr(args, "admin_token", None):
        return str(args.admin_token)
    if os.environ.get("AGENTIC_LORA_ADMIN_TOKEN"):
        return os.environ["AGENTIC_LORA_ADMIN_TOKEN"]
    path = getattr(args, "admin_token_file", None) or token_file
    return _read_token_file(path) if path else None


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


def _serve_options_from(args: argparse.Namespace) -> ServeOptions:
    config = read_config_file(args.config)
    gw = config.gateway
    settings = _settings(args, config)
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
        admin_token=_admin_token(args, gw.get("admin_token_file")),
        idle_timeout=float(idle) if idle is not None else None,
        reuse_closed_ids=bool(args.reuse_closed_ids or gw.get("reuse_closed_ids", False)),
        access_log=bool(args.access_log or gw.get("access_log", False)),
        verify_engines=not args.skip_engine_check,
    )


def serve_options(argv: Sequence[str]) -> ServeOptions:
    """Resolve ``agentic-lora serve`` arguments (``argv`` without ``serve``) to options."""
    args = build_parser().parse_args(["serve", *argv])
    return _serve_options_from(args)


def _listen(host: str, port: int) -> socket.socket:
    # Bound here, before the deployment starts, so a busy port is one clear error line.
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigurationError(
            f"cannot listen on {host}:{port}: {exc.strerror or exc}", check="port"
        ) from exc
    sock.setblocking(False)
    return sock


@dataclass(frozen=True)
class Served:
    """A running :func:`serve`: its base URL and the gateway behind it (for embedders)."""

    url: str
    gateway: Gateway


async def serve(
    options: ServeOptions,
    *,
    on_ready: Callable[[Served], None] | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Run the gateway until ``stop`` is set or SIGINT/SIGTERM arrives, then close cleanly.

    Start-up order: the port is free, the settings are valid, the engines answer and have
    enough LoRA slots (:func:`~agentic_lora.config.verify_fleet`); only then is anything served.
    On the way out every live Session is closed (released exactly once) and the journal flushed.
    ``on_ready`` receives the :class:`Served` handle once the socket accepts connections.
    """
    import uvicorn

    from agentic_lora.gateway.app import Gateway

    class _Server(uvicorn.Server):
        # Signals are ours (below): uvicorn's own handling would re-raise SIGTERM after its
        # shutdown and kill the process before the Sessions are released.
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets=sockets)
            if self.started:
                ready.set()

    ready = asyncio.Event()
    sock = _listen(options.host, options.port)
    try:
        gateway = await Gateway.from_settings(
            options.settings,
            backend_options=options.backend_options,
            admin_token=options.admin_token,
            idle_timeout=options.idle_timeout,
            reuse_closed_ids=options.reuse_closed_ids,
        )
    except BaseException:
        sock.close()
        raise
    stop = stop if stop is not None else asyncio.Event()
    loop = asyncio.get_running_loop()
    installed: list[signal.Signals] = []
    started = False
    try:
        if options.verify_engines:
            await verify_fleet(options.settings, gateway.versioning.transport)
        await gateway.start()
        server = _Server(
            uvicorn.Config(
                gateway.app,
                log_config=None,
                access_log=options.access_log,
                lifespan="off",
                timeout_graceful_shutdown=30,
            )
        )
        for sig in (signal.SIGINT, signal.SIGTERM):
            # Platforms without loop signal handlers raise NotImplementedError; serve still runs.
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(sig, stop.set)
                installed.append(sig)
        host, port = sock.getsockname()[:2]
        url = f"http://{host}:{port}" if ":" not in host else f"http://[{host}]:{port}"
        serving = asyncio.ensure_future(server.serve(sockets=[sock]))
        waiters = [asyncio.ensure_future(ready.wait()), asyncio.ensure_future(stop.wait())]
        try:
            await asyncio.wait({serving, *waiters}, return_when="FIRST_COMPLETED")
            if ready.is_set() and not stop.is_set():
                started = True
                if options.admin_token is None:
                    logger.warning("no admin token: the /admin routes are disabled")
                if on_ready is not None:
                    on_ready(Served(url, gateway))
                await asyncio.wait({serving, waiters[1]}, return_when="FIRST_COMPLETED")
        finally:
            server.should_exit = True
            for waiter in waiters:
                waiter.cancel()
            await asyncio.wait({serving})
        serving.result()
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
        sock.close()
        await gateway.aclose()
        if started:
            logger.info("agentic-lora gateway stopped")


async def _cmd_serve(args: argparse.Namespace, out: IO[str]) -> int:
    options = _serve_options_from(args)
    level = logging.getLevelName((args.log_level or "INFO").upper())
    if not isinstance(level, int):
        raise ConfigurationError(f"unknown log level {args.log_level!r}", check="log_level")
    # Until it serves, only problems are logged: a start-up failure stays one error line.
    _configure_logging(max(level, logging.WARNING), args.log_format)

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


# --- admin client commands ----------------------------------------------------------------------


def _client(args: argparse.Namespace) -> Any:
    from agentic_lora.gateway.client import AdminClient

    server = args.server or os.environ.get("AGENTIC_LORA_SERVER") or DEFAULT_SERVER
    return AdminClient(server, token=_admin_token(args))


def _seconds(value: Any) -> str:
    return f"{value:.3f}s" if isinstance(value, int | float) else "-"


def _print_event(out: IO[str], event: Mapping[str, Any]) -> None:
    status = event.get("status")
    if status == "STARTED":
        return
    where = event.get("engine") or "fleet"
    word = "done" if status == "DONE" else "FAILED"
    code = f"  {event['error_code']}" if event.get("error_code") else ""
    out.write(
        f"  {where:<8} {event.get('phase', '?'):<20} {word:<6} {_seconds(event.get('seconds'))}{code}\n"
    )
    out.flush()


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


async def _cmd_publish(args: argparse.Namespace, out: IO[str]) -> int:
    adapter_dir: str = args.adapter_dir
    if not args.json:
        out.write(f"publishing {args.version_id} from {adapter_dir}\n")
    async with _client(args) as client:
        result: dict[str, Any] = await client.publish(
            adapter_dir,
            args.version_id,
            on_event=None if args.json else (lambda event: _print_event(out, event)),
        )
    if args.json:
        out.write(json.dumps(result, indent=2) + "\n")
    return _report_publication(result, out, quiet=args.json)


def _report_publication(result: Mapping[str, Any], out: IO[str], *, quiet: bool) -> int:
    outcome = result.get("outcome")
    version = result.get("version_id")
    if outcome in ("PUBLISHED", "ALREADY_PUBLISHED"):
        if not quiet:
            commit = result.get("commit") or {}
            if outcome == "PUBLISHED":
                out.write(
                    f"PUBLISHED {version} as {result.get('lora_name')} (default revision "
                    f"{commit.get('default_revision')}, previous default "
                    f"{commit.get('previous_default') or 'none'})\n"
                )
            else:
                out.write(
                    f"ALREADY_PUBLISHED {version}: the same id and content was published "
                    "before; nothing changed\n"
                )
        return EXIT_OK
    if outcome == "SKIPPED":
        if not quiet:
            out.write(
                f"SKIPPED {version}: {result.get('reason')}: no free capacity slot (a retired "
                "version is still bound by Sessions); nothing was transferred and the default "
                "is unchanged\n"
            )
        return EXIT_NOT_PUBLISHED
    if not quiet:
        for engine in result.get("engines") or ():
            state = "ready" if engine.get("ready") else "not ready"
            cleaned = {True: ", cleaned", False: ", cleanup UNCONFIRMED", None: ""}[
                engine.get("cleaned")
            ]
            code = engine.get("error_code")
            text = _one_line(engine.get("error") or "")
            # Error texts usually start with their code already ("CODE: message").
            error = (
                ""
                if not code
                else f" ({text if text.startswith(str(code)) else f'{code}: {text}'})"
            )
            out.write(f"  {engine.get('engine')}: {state}{cleaned}{error}\n")
    reason = result.get("reason")
    if outcome == "FAILED_CLEAN":
        raise BackendRefusedError(
            f"publication of {version} ended FAILED_CLEAN ({reason}): every engine confirmed "
            "its cleanup and the default did not change",
            outcome=outcome,
        )
    raise BackendAmbiguousError(
        f"publication of {version} ended {outcome} ({reason}): a cleanup or the commit is "
        "unconfirmed, so its capacity slot stays held and later publications are blocked "
        "until it is resolved",
        outcome=outcome,
    )


def _engine_cell(version: Mapping[str, Any], engine: str) -> str:
    if engine in version.get("reclaimed_engines", ()):
        return "unloaded"
    if engine in version.get("cleaned_engines", ()):
        return "cleaned"
    if engine in version.get("ready_engines", ()):
        return "ready"
    return {
        "LOADING": "loading",
        "RECLAIMING": "unloading",
        "ABORTED": "cleaning",
    }.get(str(version.get("state")), "-")


_FINAL_STATES = ("RECLAIMED", "FAILED_CLEAN")


def _render_status(
    status: Mapping[str, Any], out: IO[str], *, show_all: bool, gateway_sessions: int | None
) -> None:
    engines = [e["engine"] for e in status.get("engines", ())]
    default = status.get("default_version")
    sessions = f"{status.get('live_sessions', 0)} in the registry"
    if gateway_sessions is not None:
        sessions += f", {gateway_sessions} open in the gateway"
    out.write(
        f"default {default or 'none'} (revision {status.get('default_revision')}) | capacity "
        f"{status.get('slots_in_use')}/{status.get('capacity')} slots in use | pending "
        f"{status.get('pending_version') or 'none'} | epoch {status.get('deployment_epoch')} | "
        f"Sessions: {sessions}\n"
    )
    versions = list(status.get("versions", ()))
    shown = [v for v in versions if show_all or v.get("state") not in _FINAL_STATES]
    header = ["VERSION", "STATE", "DIGEST", "SESSIONS", *engines]
    rows = [
        [
            str(v.get("version_id")) + (" *" if v.get("version_id") == default else ""),
            str(v.get("state")),
            str(v.get("digest", ""))[:_DIGEST_SHOWN],
            str(v.get("session_refs", 0)),
            *(_engine_cell(v, e) for e in engines),
        ]
        for v in shown
    ]
    if not rows:
        out.write("no versions yet\n" if not versions else "")
    else:
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        for row in [header, *rows]:
            out.write(
                "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
                + "\n"
            )
    hidden = len(versions) - len(shown)
    if hidden:
        out.write(f"({hidden} reclaimed or failed-clean version(s) hidden; --all shows them)\n")


async def _cmd_status(args: argparse.Namespace, out: IO[str]) -> int:
    if args.journal is not None:
        from agentic_lora.gateway.wire import status_json

        status = status_json(await _journal_status(Path(args.journal)))
        payload: dict[str, Any] = {"registry": status, "source": str(args.journal)}
        gateway_sessions = None
    else:
        async with _client(args) as client:
            payload = await client.status()
        status = payload.get("registry", {})
        gateway_sessions = payload.get("gateway", {}).get("sessions")
    if args.json:
        out.write(json.dumps(payload, indent=2) + "\n")
    else:
        _render_status(status, out, show_all=args.all, gateway_sessions=gateway_sessions)
    return EXIT_OK


async def _cmd_reclaim(args: argparse.Namespace, out: IO[str]) -> int:
    async with _client(args) as client:
        report = await client.reclaim()
    if args.json:
        out.write(json.dumps(report, indent=2) + "\n")
        return EXIT_OK
    results = report.get("results") or []
    if not results:
        out.write("nothing to reclaim (no retired version without Sessions)\n")
    for r in results:
        outcome = r.get("outcome")
        if outcome == "RECLAIMED":
            detail = f"unloaded on {', '.join(r.get('confirmed') or ()) or 'every engine'}"
        elif outcome == "PENDING":
            errors = ", ".join(f"{e} {code}" for e, code in r.get("errors") or ())
            detail = f"unconfirmed on {', '.join(r.get('unconfirmed') or ()) or '?'}; slot held, retried later ({errors})"
        else:
            detail = "a Session holds it again; not claimed"
        out.write(f"{r.get('version_id')}  {outcome}  {detail}\n")
    return EXIT_OK


async def _cmd_resolve(args: argparse.Namespace, out: IO[str]) -> int:
    async with _client(args) as client:
        report: dict[str, Any] = await client.resolve(args.version)
    results = report.get("results") or []
    if args.json:
        out.write(json.dumps(report, indent=2) + "\n")
    elif not results:
        out.write("nothing to resolve (no blocked or abandoned publication)\n")
    blocked = []
    for r in results:
        version, outcome, reason = r.get("version_id"), r.get("outcome"), r.get("reason")
        if outcome == "BLOCKED":
            blocked.append(r)
        if args.json:
            continue
        cleaned = [e.get("engine") for e in r.get("engines") or () if e.get("cleaned")]
        detail = f": cleanup confirmed on {', '.join(map(str, cleaned))}" if cleaned else ""
        out.write(f"{version}  {outcome}  {reason}{detail}\n")
        if outcome == "BLOCKED":
            for engine in r.get("engines") or ():
                if engine.get("cleaned") is False:
                    error = _one_line(engine.get("error") or engine.get("error_code") or "")
                    out.write(f"  {engine.get('engine')}: cleanup UNCONFIRMED ({error})\n")
    if blocked:
        first = blocked[0]
        raise BackendAmbiguousError(
            f"{first.get('version_id')} is still BLOCKED ({first.get('reason')}): its capacity "
            "slot stays held; the server keeps retrying the cleanup in the background",
            outcome="BLOCKED",
            blocked=[r.get("version_id") for r in blocked],
        )
    return EXIT_OK


# --- read-only journal status -------------------------------------------------------------------


def _copy_journal(source: Path, target: Path) -> None:
    # SQLite's backup API gives a consistent copy even while a server appends. A journal with a
    # write-ahead log may have frames not yet in the main file: read it read-only (``mode=ro``).
    # Without one, nothing is pending and ``immutable=1`` reads without creating any lock file.
    mode = "mode=ro" if Path(f"{source}-wal").exists() else "immutable=1"
    try:
        src = sqlite3.connect(f"{source.resolve().as_uri()}?{mode}", uri=True)
    except sqlite3.Error as exc:
        raise JournalForeignError(f"{source} cannot be opened: {exc}", path=str(source)) from exc
    try:
        dst = sqlite3.connect(target)
        try:
            src.backup(dst)
        finally:
            dst.close()
    except sqlite3.DatabaseError as exc:
        raise JournalForeignError(
            f"{source} is not a readable SQLite journal: {exc}", path=str(source)
        ) from exc
    finally:
        src.close()


def _journal_identity(copy: Path, source: Path) -> dict[str, Any]:
    conn = sqlite3.connect(copy)
    try:
        row = conn.execute("SELECT value FROM meta WHERE key = 'identity'").fetchone()
    except sqlite3.DatabaseError:
        row = None
    finally:
        conn.close()
    try:
        identity = json.loads(row[0]) if row is not None else None
    except ValueError:
        identity = None
    if (
        not isinstance(identity, dict)
        or not {"engines", "capacity", "deployment_epoch", "prefix"} <= identity.keys()
    ):
        raise JournalForeignError(
            f"{source} is not an agentic-lora registry journal", path=str(source)
        )
    return identity


async def _journal_status(path: Path) -> RegistryStatus:
    from agentic_lora.registry.local import LocalRegistry

    if not await asyncio.to_thread(path.is_file):
        raise ConfigurationError(f"no registry journal at {path}", check="journal_path")
    with tempfile.TemporaryDirectory(prefix="agentic-lora-status-") as tmp:
        copy = Path(tmp) / "journal.sqlite"
        await asyncio.to_thread(_copy_journal, path, copy)
        identity = _journal_identity(copy, path)
        registry = LocalRegistry(
            engines=list(identity["engines"]),
            capacity=int(identity["capacity"]),
            deployment_epoch=int(identity["deployment_epoch"]),
            prefix=str(identity["prefix"]),
            journal_path=copy,
        )
        try:
            return await registry.status()
        finally:
            await registry.aclose()


# --- doctor -------------------------------------------------------------------------------------

CheckStatus = Literal["ok", "fail", "skip"]


@dataclass(frozen=True)
class DoctorCheck:
    """One line of ``agentic-lora doctor``: where, what, and whether it holds."""

    scope: str
    name: str
    status: CheckStatus
    detail: str = ""


def _int_field(info: Mapping[str, Any], key: str) -> int | None:
    value = info.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _adapter_rank(snapshot: AdapterSnapshot) -> int:
    ranks = [int(snapshot.config["r"])]
    pattern = snapshot.config.get("rank_pattern") or {}
    ranks.extend(int(r) for r in pattern.values())
    return max(ranks)


def _engine_checks(
    ref: EngineRef,
    settings: AgenticLoRASettings,
    info: Mapping[str, Any],
    adapter: AdapterSnapshot | None,
) -> list[DoctorCheck]:
    name = ref.name
    checks: list[DoctorCheck] = []

    def add(check: str, ok: bool | None, detail: str) -> None:
        status: CheckStatus = "skip" if ok is None else "ok" if ok else "fail"
        checks.append(DoctorCheck(name, check, status, detail))

    served = info.get("served_model_name") or info.get("model_path")
    add("reachable", True, f"SGLang {info.get('version', '?')} serving {served}")
    add(
        "lora enabled",
        bool(info.get("enable_lora")),
        "--enable-lora is on" if info.get("enable_lora") else "runs without --enable-lora",
    )
    base = settings.base_model_name
    if base is None:
        add("served model", None, "base_model_name is not set")
    else:
        add(
            "served model",
            served == base,
            f"serves {served!r}"
            + ("" if served == base else f", settings say base_model_name {base!r}"),
        )
    capacity = settings.capacity
    loaded = _int_field(info, "max_loaded_loras")
    if loaded is None:
        add("loaded slots", None, "max_loaded_loras not reported")
    else:
        add(
            "loaded slots",
            loaded >= capacity + 1,
            f"max_loaded_loras {loaded} {'>=' if loaded >= capacity + 1 else '<'} capacity + 1 "
            f"= {capacity + 1}",
        )
    per_batch = _int_field(info, "max_loras_per_batch")
    if per_batch is None:
        add("pinned limit", None, "max_loras_per_batch not reported")
    else:
        pinnable = per_batch - 1
        add(
            "pinned limit",
            pinnable >= capacity,
            f"max_loras_per_batch {per_batch} leaves {pinnable} pinnable "
            f"{'>=' if pinnable >= capacity else '<'} capacity {capacity}",
        )
    for key, declared, actual in (
        ("max_loaded_loras", settings.engine_max_loaded_loras, loaded),
        ("max_loras_per_batch", settings.engine_max_loras_per_batch, per_batch),
    ):
        if declared is not None and actual is not None and declared != actual:
            add("declared slots", False, f"runs with {key}={actual}, settings say {declared}")
    max_rank = _int_field(info, "max_lora_rank")
    if adapter is None:
        add(
            "max lora rank",
            None if max_rank is None else True,
            f"max_lora_rank {max_rank}" if max_rank is not None else "max_lora_rank not reported",
        )
    elif max_rank is None:
        add("max lora rank", None, "max_lora_rank not reported; cannot check the adapter")
    else:
        rank = _adapter_rank(adapter)
        add(
            "max lora rank",
            rank <= max_rank,
            f"adapter rank {rank} {'<=' if rank <= max_rank else '>'} max_lora_rank {max_rank}",
        )
    served_modules = info.get("lora_target_modules")
    if adapter is not None and isinstance(served_modules, list) and "all" not in served_modules:
        wanted = adapter.config.get("target_modules")
        if isinstance(wanted, tuple | list):
            missing = sorted(set(wanted) - set(served_modules))
            add(
                "target modules",
                not missing,
                "adapter targets are served"
                if not missing
                else f"adapter targets {missing} the engine does not serve ({sorted(served_modules)})",
            )
    return checks


async def _probe_engine(
    ref: EngineRef,
    settings: AgenticLoRASettings,
    client: httpx.AsyncClient,
    adapter: AdapterSnapshot | None,
) -> list[DoctorCheck]:
    admin = EngineAdminClient(
        ref.base_url,
        engine=ref.name,
        client=client,
        timeouts=AdminTimeouts(connect=settings.connect_timeout, read=settings.connect_timeout * 4),
    )
    try:
        info = await admin.server_info()
    except BackendError as exc:
        return [DoctorCheck(ref.name, "reachable", "fail", _one_line(exc.message))]
    return _engine_checks(ref, settings, info.raw, adapter)


def _router_checks(settings: AgenticLoRASettings) -> list[DoctorCheck]:
    if settings.gateway_url is None:
        return [
            DoctorCheck(
                "router", "retries off", "skip", "no gateway_url: engines are reached directly"
            )
        ]
    if settings.gateway_retries_disabled:
        return [
            DoctorCheck(
                "router",
                "retries off",
                "ok",
                f"{settings.gateway_url}: asserted to run with --disable-retries",
            )
        ]
    return [
        DoctorCheck(
            "router",
            "retries off",
            "fail",
            f"{settings.gateway_url} may retry failed generations (SGLang's router does by "
            "default): start it with --disable-retries and set gateway_retries_disabled",
        )
    ]


def _store_checks(options: Mapping[str, Any]) -> list[DoctorCheck]:
    root = options.get("store_root")
    if not isinstance(root, str):
        return []
    path = Path(root)
    if not path.is_absolute():
        return [DoctorCheck("backend", "store root", "fail", f"{root} is not an absolute path")]
    probe = path if path.exists() else path.parent
    ok = probe.is_dir() and os.access(probe, os.W_OK | os.X_OK)
    return [
        DoctorCheck(
            "backend",
            "store root",
            "ok" if ok else "fail",
            f"{root} {'is writable' if ok else 'is not a writable directory'}",
        )
    ]


async def run_doctor(args: argparse.Namespace, config: ConfigFile) -> list[DoctorCheck]:
    """Every doctor check for the settings ``args`` and ``config`` resolve to."""
    checks: list[DoctorCheck] = []
    try:
        settings = _settings(args, config)
        checks.append(DoctorCheck("config", "settings", "ok", "valid"))
    except ConfigurationError as exc:
        checks.append(DoctorCheck("config", "settings", "fail", _one_line(exc.message)))
        # Relaxed: only the fleet list must parse, so the engines can still be checked.
        settings = _settings(args, config, enable=False)
    adapter = None
    if args.adapter is not None:
        adapter = await asyncio.to_thread(AdapterSnapshot.from_peft_dir, args.adapter)
    async with httpx.AsyncClient(trust_env=False) as client:
        per_engine = await asyncio.gather(
            *(_probe_engine(ref, settings, client, adapter) for ref in settings.engines)
        )
    for engine_checks in per_engine:
        checks.extend(engine_checks)
    checks.extend(_router_checks(settings))
    checks.extend(_store_checks(config.backend_options))
    return checks


async def _cmd_doctor(args: argparse.Namespace, out: IO[str]) -> int:
    config = read_config_file(args.config)
    checks = await run_doctor(args, config)
    failed = [c for c in checks if c.status == "fail"]
    if args.json:
        out.write(json.dumps([vars(c) for c in checks], indent=2) + "\n")
    else:
        scope = None
        for c in checks:
            if c.scope != scope:
                scope = c.scope
                out.write(f"{scope}\n")
            label = {"ok": "ok", "fail": "FAIL", "skip": "skip"}[c.status]
            out.write(f"  {label:<5} {c.name:<15} {c.detail}\n")
        if not failed:
            out.write("all checks passed\n")
    if failed:
        first = failed[0]
        raise ConfigurationError(
            f"doctor found {len(failed)} problem(s); first: {first.scope} {first.name}: "
            f"{first.detail}",
            check="doctor",
            problems=[vars(c) for c in failed],
        )
    return EXIT_OK


# --- demo ---------------------------------------------------------------------------------------


def _demo_script(given: str | None) -> Path:
    if given is not None:
        candidates = [Path(given)]
    else:
        package_root = Path(__file__).resolve().parent.parent
        candidates = [Path.cwd() / "examples" / "demo.py", package_root / "examples" / "demo.py"]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise ConfigurationError(
        f"no demo script: looked for {', '.join(str(c) for c in dict.fromkeys(candidates))}",
        check="demo",
    )


async def _cmd_demo(args: argparse.Namespace, out: IO[str]) -> int:
    script = _demo_script(args.script)
    extra = list(args.demo_args)
    if extra[:1] == ["--"]:
        extra = extra[1:]
    process = await asyncio.create_subprocess_exec(sys.executable, str(script), *extra)
    try:
        return await process.wait()
    except asyncio.CancelledError:
        with contextlib.suppress(ProcessLookupError):
            process.terminate()
        await process.wait()
        raise


def _absolute_path(value: str) -> str:
    # The gateway resolves nothing: it reads exactly the path it is given.
    return os.path.abspath(os.path.expanduser(value))


# --- parser -------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The ``agentic-lora`` argument parser (every subcommand)."""
    parser = _Parser(
        prog="agentic-lora",
        description="Immutable LoRA versions, Session binding at first generation, safe reclaim.",
    )
    parser.add_argument("--debug", action="store_true", help="print tracebacks of failures")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    client = _Parser(add_help=False)
    client.add_argument(
        "--server",
        help=f"gateway base URL (env AGENTIC_LORA_SERVER; default {DEFAULT_SERVER})",
    )
    client.add_argument("--admin-token", help="admin token (env AGENTIC_LORA_ADMIN_TOKEN)")
    client.add_argument("--admin-token-file", help="file holding the admin token")

    configured = _Parser(add_help=False)
    configured.add_argument(
        "--config",
        default=os.environ.get("AGENTIC_LORA_CONFIG"),
        help="config file, TOML or JSON (env AGENTIC_LORA_CONFIG)",
    )
    add_arguments(configured)

    p = sub.add_parser(
        "serve",
        parents=[configured],
        help="run registry, publisher, reclaimer and gateway",
        description="Run the registry, publisher, background reclaimer and the Session gateway.",
    )
    p.add_argument("--host", help=f"listen address (default {DEFAULT_HOST})")
    p.add_argument("--port", type=int, help=f"listen port (default {DEFAULT_PORT}; 0: any)")
    p.add_argument("--admin-token", help="admin token (env AGENTIC_LORA_ADMIN_TOKEN)")
    p.add_argument("--admin-token-file", help="file holding the admin token")
    p.add_argument(
        "--backend-option",
        action="append",
        metavar="KEY=VALUE",
        help="backend plugin option, e.g. store_root=/srv/adapters (repeatable)",
    )
    p.add_argument("--idle-timeout", type=float, help="close Sessions idle this many seconds")
    p.add_argument(
        "--reuse-closed-ids",
        action="store_true",
        help="let a closed Session id open a new Session (default: refused)",
    )
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")
    p.add_argument(
        "--skip-engine-check",
        action="store_true",
        help="do not check the engines' LoRA settings at start-up",
    )
    p.add_argument("--log-level", help="logging level (default INFO)")
    p.add_argument("--log-format", choices=["text", "json"], default="text", help="log format")
    p.set_defaults(handler=_cmd_serve)

    p = sub.add_parser(
        "publish",
        parents=[client],
        help="publish an adapter directory as a new version",
        description="Publish a PEFT adapter directory (read by the gateway's host) as a version.",
    )
    p.add_argument(
        "adapter_dir",
        metavar="ADAPTER_DIR",
        type=_absolute_path,
        help="PEFT adapter directory (the gateway reads it; give a path on its host)",
    )
    p.add_argument("--version-id", required=True, help="the new version's id")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(handler=_cmd_publish)

    p = sub.add_parser(
        "status",
        parents=[client],
        help="versions, Sessions and per-engine readiness",
        description="Show versions (state, digest, Session refs, per-engine readiness) and the "
        "default. With --journal, read a journaled registry directly (read-only, no server).",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--all", action="store_true", help="also list reclaimed/failed versions")
    p.add_argument("--journal", help="read this registry journal instead of a server")
    p.set_defaults(handler=_cmd_status)

    p = sub.add_parser(
        "reclaim",
        parents=[client],
        help="reclaim retired versions without Sessions now",
        description="Run one reclaim round now (the server also does this on its own).",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(handler=_cmd_reclaim)

    p = sub.add_parser(
        "resolve",
        parents=[client],
        help="finish blocked or abandoned publications now",
        description="Abort and clean up a publication left LOADING or ABORTED (its cleanup "
        "unconfirmed on some engine), freeing its capacity slot once every engine confirmed. "
        "Without VERSION: every such publication. The server also retries on its own.",
    )
    p.add_argument("version", metavar="VERSION", nargs="?", help="the version id to resolve")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(handler=_cmd_resolve)

    p = sub.add_parser(
        "doctor",
        parents=[configured],
        help="check every engine against the settings",
        description="Check each engine (reachable, LoRA on, slots vs capacity, pinned limit, "
        "max rank) and the router's retry assertion.",
    )
    p.add_argument("--adapter", help="also check this adapter directory fits the engines")
    p.add_argument("--json", action="store_true", help="print the checks as JSON")
    p.set_defaults(handler=_cmd_doctor)

    p = sub.add_parser(
        "demo",
        help="run examples/demo.py",
        description="Run the demo script (examples/demo.py), passing the remaining arguments.",
    )
    p.add_argument("--script", help="the demo script (default: examples/demo.py)")
    p.add_argument("demo_args", nargs=argparse.REMAINDER, help="arguments for the demo")
    p.set_defaults(handler=_cmd_demo)
    return parser


# --- entry points -------------------------------------------------------------------------------


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
    err.write(_one_line(line) + "\n")
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
    except _UsageError as exc:
        err.write(f"error: {ConfigurationError.code}: {_one_line(str(exc))}\n")
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


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
