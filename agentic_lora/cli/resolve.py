"""``agentic-lora resolve [VERSION] [--json]``: finish blocked or abandoned publications now."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from typing import IO
from typing import Any

from agentic_lora.cli.common import EXIT_OK
from agentic_lora.cli.common import JSON
from agentic_lora.cli.common import Command
from agentic_lora.cli.common import Needs
from agentic_lora.cli.common import admin_client
from agentic_lora.cli.common import argument
from agentic_lora.cli.common import one_line
from agentic_lora.errors import BackendAmbiguousError

__all__ = ["COMMAND", "run"]


def _print_result(r: Mapping[str, Any], out: IO[str]) -> None:
    version, outcome, reason = r.get("version_id"), r.get("outcome"), r.get("reason")
    cleaned = [e.get("engine") for e in r.get("engines") or () if e.get("cleaned")]
    detail = f": cleanup confirmed on {', '.join(map(str, cleaned))}" if cleaned else ""
    out.write(f"{version}  {outcome}  {reason}{detail}\n")
    if outcome == "BLOCKED":
        for engine in r.get("engines") or ():
            if engine.get("cleaned") is False:
                error = one_line(engine.get("error") or engine.get("error_code") or "")
                out.write(f"  {engine.get('engine')}: cleanup UNCONFIRMED ({error})\n")


async def run(args: argparse.Namespace, out: IO[str]) -> int:
    async with admin_client(args) as client:
        report: dict[str, Any] = await client.resolve(args.version)
    results = report.get("results") or []
    if args.json:
        out.write(json.dumps(report, indent=2) + "\n")
    elif not results:
        out.write("nothing to resolve (no blocked or abandoned publication)\n")
    else:
        for r in results:
            _print_result(r, out)
    blocked = [r for r in results if r.get("outcome") == "BLOCKED"]
    if blocked:
        first = blocked[0]
        raise BackendAmbiguousError(
            f"{first.get('version_id')} is still BLOCKED ({first.get('reason')}): its capacity "
            "slot stays held; the server keeps retrying the cleanup in the background",
            outcome="BLOCKED",
            blocked=[r.get("version_id") for r in blocked],
        )
    return EXIT_OK


COMMAND = Command(
    "resolve",
    Needs.SERVER,
    run,
    arguments=(
        argument("version", metavar="VERSION", nargs="?", help="the version id to resolve"),
        JSON,
    ),
    help="finish blocked or abandoned publications now",
    description="Abort and clean up a publication left LOADING or ABORTED (its cleanup "
    "unconfirmed on some engine), freeing its capacity slot once every engine confirmed. "
    "Without VERSION: every such publication. The server also retries on its own.",
)
