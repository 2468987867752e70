"""``agentic-lora status [--json] [--all] [--journal PATH]``: versions, Session refs and
per-engine readiness, from a running server or, read-only, from a journal."""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import IO
from typing import Any

from agentic_lora.cli.common import EXIT_OK
from agentic_lora.cli.common import JSON
from agentic_lora.cli.common import Command
from agentic_lora.cli.common import Needs
from agentic_lora.cli.common import admin_client
from agentic_lora.cli.common import argument
from agentic_lora.errors import ConfigurationError
from agentic_lora.registry.journal import Journal
from agentic_lora.registry.types import RegistryStatus

__all__ = ["COMMAND", "journal_status", "run"]

_DIGEST_SHOWN = 12
_FINAL_STATES = ("RECLAIMED", "FAILED_CLEAN")


def _engine_cell(version: Mapping[str, Any], engine: str) -> str:
    if engine in version.get("reclaimed_engines", ()):
        return "unloaded"
    if engine in version.get("cleaned_engines", ()):
        return "cleaned"
    if engine in version.get("ready_engines", ()):
        return "ready"
    if engine in version.get("held_engines", ()):
        return "held"  # loaded on a member that is not ACTIVE: nothing is routed there
    return {
        "LOADING": "loading",
        "RECLAIMING": "unloading",
        "ABORTED": "cleaning",
    }.get(str(version.get("state")), "-")


def _render(
    status: Mapping[str, Any], out: IO[str], *, show_all: bool, gateway_sessions: int | None
) -> None:
    engines = [e["engine"] for e in status.get("engines", ())]
    default = status.get("default_version")
    sessions = f"{status.get('live_sessions', 0)} in the registry"
    if gateway_sessions is not None:
        sessions += f", {gateway_sessions} open in the gateway"
    origin = status.get("rolled_back_from")
    rollback = f", rolled back from {origin}" if origin else ""
    out.write(
        f"default {default or 'none'} (revision {status.get('default_revision')}{rollback}) | capacity "
        f"{status.get('slots_in_use')}/{status.get('capacity')} slots in use | pending "
        f"{status.get('pending_version') or 'none'} | epoch {status.get('deployment_epoch')} | "
        f"Sessions: {sessions}\n"
    )
    members = [(e["engine"], e.get("membership", "ACTIVE")) for e in status.get("engines", ())]
    if any(m != "ACTIVE" for _, m in members):
        out.write("engines: " + ", ".join(f"{e} {m}" for e, m in members) + "\n")
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


async def journal_status(path: Path) -> RegistryStatus:
    """The status a journaled registry would report, read from a consistent copy of ``path``
    (the journal itself is never written to)."""
    from agentic_lora.registry.local import LocalRegistry

    if not await asyncio.to_thread(path.is_file):
        raise ConfigurationError(f"no registry journal at {path}", check="journal_path")
    with tempfile.TemporaryDirectory(prefix="agentic-lora-status-") as tmp:
        copy = await asyncio.to_thread(Journal.read_only_copy, path, Path(tmp) / "journal.sqlite")
        identity = copy.identity_values
        registry = LocalRegistry(
            engines=list(identity["engines"]),
            capacity=int(identity["capacity"]),
            deployment_epoch=int(identity["deployment_epoch"]),
            prefix=str(identity["prefix"]),
            journal_path=copy.path,
        )
        try:
            return await registry.status()
        finally:
            await registry.aclose()


async def run(args: argparse.Namespace, out: IO[str]) -> int:
    if args.journal is not None:
        from agentic_lora.gateway.wire import status_json

        status = status_json(await journal_status(Path(args.journal)))
        payload: dict[str, Any] = {"registry": status, "source": str(args.journal)}
        gateway_sessions = None
    else:
        async with admin_client(args) as client:
            payload = await client.status()
        status = payload.get("registry", {})
        gateway_sessions = payload.get("gateway", {}).get("sessions")
    if args.json:
        out.write(json.dumps(payload, indent=2) + "\n")
    else:
        _render(status, out, show_all=args.all, gateway_sessions=gateway_sessions)
    return EXIT_OK


COMMAND = Command(
    "status",
    Needs.SERVER,
    run,
    arguments=(
        JSON,
        argument("--all", action="store_true", help="also list reclaimed/failed versions"),
        argument("--journal", help="read this registry journal instead of a server"),
    ),
    help="versions, Sessions and per-engine readiness",
    description="Show versions (state, digest, Session refs, per-engine readiness) and the "
    "default. With --journal, read a journaled registry directly (read-only, no server).",
)
