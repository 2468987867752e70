"""``agentic-lora rollback VERSION [--adapter-dir DIR] [--json]``: make a version that was the
default before the default again, without a restart (exit 0 rolled back, 3 skipped for capacity,
1 failed or blocked)."""

from __future__ import annotations

import argparse
import json
from typing import IO
from typing import Any

from agentic_lora.cli.common import EXIT_OK
from agentic_lora.cli.common import JSON
from agentic_lora.cli.common import Command
from agentic_lora.cli.common import Needs
from agentic_lora.cli.common import absolute_path
from agentic_lora.cli.common import admin_client
from agentic_lora.cli.common import argument
from agentic_lora.cli.publish import report_publication

__all__ = ["COMMAND", "run"]


async def run(args: argparse.Namespace, out: IO[str]) -> int:
    async with admin_client(args) as client:
        result: dict[str, Any] = await client.rollback(args.version, adapter_dir=args.adapter_dir)
    if args.json:
        out.write(json.dumps(result, indent=2) + "\n")
    outcome = result.get("outcome")
    if outcome not in ("PUBLISHED", "ALREADY_PUBLISHED"):
        return report_publication(result, out, quiet=args.json)
    if not args.json:
        commit = result.get("commit") or {}
        again = "" if outcome == "PUBLISHED" else " already (this rollback); nothing changed"
        out.write(
            f"ROLLED BACK to {result.get('version_id')} as {result.get('lora_name')}{again}: "
            f"default revision {commit.get('default_revision')}, rolled back from "
            f"{commit.get('previous_default')}; Sessions bound before keep their version\n"
        )
    return EXIT_OK


COMMAND = Command(
    "rollback",
    Needs.SERVER,
    run,
    arguments=(
        argument("version", metavar="VERSION", help="the version id to make the default again"),
        argument(
            "--adapter-dir",
            type=absolute_path,
            help="its PEFT adapter directory on the gateway's host (only for a reclaimed version "
            "the gateway's store no longer holds)",
        ),
        JSON,
    ),
    help="make an earlier version the default again",
    description="Make VERSION, a version that was the default before, the default again without "
    "a restart: two-phase like a publication (every engine holds it before the default moves). "
    "Sessions already bound keep their version; new Sessions bind VERSION. A reclaimed VERSION is "
    "loaded again from the gateway's store (or --adapter-dir).",
)
