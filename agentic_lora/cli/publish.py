"""``agentic-lora publish ADAPTER_DIR --version-id ID``: progress per engine and phase, then the
outcome (exit 0 published, 3 skipped, 1 failed or blocked)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from typing import IO
from typing import Any

from agentic_lora.cli.common import EXIT_NOT_PUBLISHED
from agentic_lora.cli.common import EXIT_OK
from agentic_lora.cli.common import Command
from agentic_lora.cli.common import Needs
from agentic_lora.cli.common import absolute_path
from agentic_lora.cli.common import admin_client
from agentic_lora.cli.common import argument
from agentic_lora.cli.common import one_line
from agentic_lora.errors import BackendAmbiguousError
from agentic_lora.errors import BackendRefusedError

__all__ = ["COMMAND", "report_publication", "run"]


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


def _engine_line(engine: Mapping[str, Any]) -> str:
    state = "ready" if engine.get("ready") else "not ready"
    cleaned = {True: ", cleaned", False: ", cleanup UNCONFIRMED", None: ""}[engine.get("cleaned")]
    code = engine.get("error_code")
    text = one_line(engine.get("error") or "")
    # Error texts usually start with their code already ("CODE: message").
    error = "" if not code else f" ({text if text.startswith(str(code)) else f'{code}: {text}'})"
    return f"  {engine.get('engine')}: {state}{cleaned}{error}\n"


def report_publication(result: Mapping[str, Any], out: IO[str], *, quiet: bool) -> int:
    """Print a publication result (unless ``quiet``); its exit code, or its typed error."""
    outcome = result.get("outcome")
    version = result.get("version_id")
    if outcome in ("PUBLISHED", "ALREADY_PUBLISHED"):
        if quiet:
            return EXIT_OK
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
            out.write(_engine_line(engine))
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


async def run(args: argparse.Namespace, out: IO[str]) -> int:
    adapter_dir: str = args.adapter_dir
    if not args.json:
        out.write(f"publishing {args.version_id} from {adapter_dir}\n")
    async with admin_client(args) as client:
        result: dict[str, Any] = await client.publish(
            adapter_dir,
            args.version_id,
            on_event=None if args.json else (lambda event: _print_event(out, event)),
        )
    if args.json:
        out.write(json.dumps(result, indent=2) + "\n")
    return report_publication(result, out, quiet=args.json)


COMMAND = Command(
    "publish",
    Needs.SERVER,
    run,
    arguments=(
        argument(
            "adapter_dir",
            metavar="ADAPTER_DIR",
            type=absolute_path,
            help="PEFT adapter directory (the gateway reads it; give a path on its host)",
        ),
        argument("--version-id", required=True, help="the new version's id"),
        argument("--json", action="store_true", help="print the result as JSON"),
    ),
    help="publish an adapter directory as a new version",
    description="Publish a PEFT adapter directory (read by the gateway's host) as a version.",
)
