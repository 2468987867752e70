"""``agentic-lora reclaim [--json]``: one reclaim round now (the server also reclaims on its own)."""

from __future__ import annotations

import argparse
import json
from typing import IO

from agentic_lora.cli.common import EXIT_OK
from agentic_lora.cli.common import JSON
from agentic_lora.cli.common import Command
from agentic_lora.cli.common import Needs
from agentic_lora.cli.common import admin_client

__all__ = ["COMMAND", "run"]


async def run(args: argparse.Namespace, out: IO[str]) -> int:
    async with admin_client(args) as client:
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
            unconfirmed = ", ".join(r.get("unconfirmed") or ()) or "?"
            detail = f"unconfirmed on {unconfirmed}; slot held, retried later ({errors})"
        else:
            detail = "a Session holds it again; not claimed"
        out.write(f"{r.get('version_id')}  {outcome}  {detail}\n")
    return EXIT_OK


COMMAND = Command(
    "reclaim",
    Needs.SERVER,
    run,
    arguments=(JSON,),
    help="reclaim retired versions without Sessions now",
    description="Run one reclaim round now (the server also does this on its own).",
)
