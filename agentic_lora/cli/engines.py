"""``agentic-lora engines list|add|drain|remove [ENGINE] [--json]``: the fleet's membership, and
engines added, drained and removed at runtime (see :mod:`agentic_lora.registry.membership`)."""

from __future__ import annotations

import argparse
import json
from typing import IO
from typing import Any

from agentic_lora.cli.common import EXIT_OK
from agentic_lora.cli.common import JSON
from agentic_lora.cli.common import Command
from agentic_lora.cli.common import Needs
from agentic_lora.cli.common import admin_client
from agentic_lora.cli.common import argument
from agentic_lora.errors import InvalidRequestError

__all__ = ["COMMAND", "run"]


async def run(args: argparse.Namespace, out: IO[str]) -> int:
    action = None if args.action == "list" else args.action
    if action is not None and not args.engine:
        raise InvalidRequestError(f"engines {action} needs an ENGINE name")
    async with admin_client(args) as client:
        report: dict[str, Any] = await client.engines(action, args.engine)
    if args.json:
        out.write(json.dumps(report, indent=2) + "\n")
        return EXIT_OK
    if action is not None:
        out.write(f"{report.get('engine')}: {report.get('membership')}\n")
        drain = report.get("drain")
        if isinstance(drain, dict):
            out.write(
                f"drain {drain.get('outcome')}: {drain.get('in_flight_at_drain')} in flight at "
                f"the drain, {drain.get('in_flight')} left, waited {drain.get('waited_s')} s\n"
            )
    for e in report.get("engines") or ():
        out.write(f"{e.get('engine')}  {e.get('membership')}  {e.get('incarnation') or '-'}\n")
    return EXIT_OK


COMMAND = Command(
    "engines",
    Needs.SERVER,
    run,
    arguments=(
        argument(
            "action",
            metavar="ACTION",
            choices=("list", "add", "drain", "remove"),
            help="list, add, drain or remove",
        ),
        argument("engine", metavar="ENGINE", nargs="?", help="the engine (not for list)"),
        JSON,
    ),
    help="list, add, drain or remove engines at runtime",
    description="List the fleet's engines with their membership (JOINING, ACTIVE, DRAINING, "
    "EJECTED), or change one: add (an engine of the configured fleet joins; every dispatchable "
    "version is loaded onto it before it is routed to), drain (no new work; its Sessions continue "
    "on the members that hold their version), remove (a drained or ejected engine leaves).",
)
