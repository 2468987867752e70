"""``agentic-lora doctor``: check every engine against the settings before serving.

The LoRA and slot rules are the ones ``serve`` enforces at start-up
(:func:`~agentic_lora.config.check_engine_server_info`); doctor adds what start-up does not
check (the served model name, an adapter's rank and target modules, the router's retries and
the store root) and reports every check instead of stopping at the first.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO
from typing import Any
from typing import Literal

import httpx

from agentic_lora.adapters.snapshot import AdapterSnapshot
from agentic_lora.cli.common import EXIT_OK
from agentic_lora.cli.common import Command
from agentic_lora.cli.common import Needs
from agentic_lora.cli.common import argument
from agentic_lora.cli.common import one_line
from agentic_lora.cli.config_file import ConfigFile
from agentic_lora.cli.config_file import layered_settings
from agentic_lora.cli.config_file import read_config_file
from agentic_lora.config import AgenticLoRASettings
from agentic_lora.config import check_engine_server_info
from agentic_lora.engines.admin import AdminTimeouts
from agentic_lora.engines.admin import EngineAdminClient
from agentic_lora.engines.backends import EngineRef
from agentic_lora.errors import BackendError
from agentic_lora.errors import ConfigurationError
from agentic_lora.foundation.http_limits import engine_limits

__all__ = ["COMMAND", "CheckStatus", "DoctorCheck", "run", "run_doctor"]

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


class _Checks:
    """The checks of one scope, in the order they are added."""

    def __init__(self, scope: str) -> None:
        self.scope = scope
        self.items: list[DoctorCheck] = []

    def add(self, name: str, ok: bool | None, detail: str) -> None:
        status: CheckStatus = "skip" if ok is None else "ok" if ok else "fail"
        self.items.append(DoctorCheck(self.scope, name, status, detail))


def _lora_settings(checks: _Checks, settings: AgenticLoRASettings, info: Mapping[str, Any]) -> None:
    try:
        check_engine_server_info(settings, checks.scope, info)
    except ConfigurationError as exc:
        checks.add("lora settings", False, one_line(exc.message))
        return
    slots = {k: _int_field(info, k) for k in ("max_loaded_loras", "max_loras_per_batch")}
    reported = ", ".join(f"{k} {v}" for k, v in slots.items() if v is not None)
    checks.add(
        "lora settings",
        True,
        f"LoRA on; {reported or 'slot counts not reported'}; capacity {settings.capacity}",
    )


def _adapter_checks(
    checks: _Checks, info: Mapping[str, Any], adapter: AdapterSnapshot | None
) -> None:
    max_rank = _int_field(info, "max_lora_rank")
    if adapter is None:
        checks.add(
            "max lora rank",
            None if max_rank is None else True,
            f"max_lora_rank {max_rank}" if max_rank is not None else "max_lora_rank not reported",
        )
        return
    if max_rank is None:
        checks.add("max lora rank", None, "max_lora_rank not reported; cannot check the adapter")
    else:
        rank = _adapter_rank(adapter)
        checks.add(
            "max lora rank",
            rank <= max_rank,
            f"adapter rank {rank} {'<=' if rank <= max_rank else '>'} max_lora_rank {max_rank}",
        )
    served_modules = info.get("lora_target_modules")
    wanted = adapter.config.get("target_modules")
    if (
        isinstance(served_modules, list)
        and "all" not in served_modules
        and isinstance(wanted, tuple | list)
    ):
        missing = sorted(set(wanted) - set(served_modules))
        checks.add(
            "target modules",
            not missing,
            "adapter targets are served"
            if not missing
            else f"adapter targets {missing} the engine does not serve ({sorted(served_modules)})",
        )


def _engine_checks(
    ref: EngineRef,
    settings: AgenticLoRASettings,
    info: Mapping[str, Any],
    adapter: AdapterSnapshot | None,
) -> list[DoctorCheck]:
    checks = _Checks(ref.name)
    served = info.get("served_model_name") or info.get("model_path")
    checks.add("reachable", True, f"SGLang {info.get('version', '?')} serving {served}")
    _lora_settings(checks, settings, info)
    base = settings.base_model_name
    if base is None:
        checks.add("served model", None, "base_model_name is not set")
    else:
        checks.add(
            "served model",
            served == base,
            f"serves {served!r}"
            + ("" if served == base else f", settings say base_model_name {base!r}"),
        )
    _adapter_checks(checks, info, adapter)
    return checks.items


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
        return [DoctorCheck(ref.name, "reachable", "fail", one_line(exc.message))]
    return _engine_checks(ref, settings, info.raw, adapter)


def _router_checks(settings: AgenticLoRASettings) -> list[DoctorCheck]:
    checks = _Checks("router")
    if settings.gateway_url is None:
        checks.add("retries off", None, "no gateway_url: engines are reached directly")
    elif settings.gateway_retries_disabled:
        checks.add(
            "retries off",
            True,
            f"{settings.gateway_url}: asserted to run with --disable-retries",
        )
    else:
        checks.add(
            "retries off",
            False,
            f"{settings.gateway_url} may retry failed generations (SGLang's router does by "
            "default): start it with --disable-retries and set gateway_retries_disabled",
        )
    return checks.items


def _store_checks(options: Mapping[str, Any]) -> list[DoctorCheck]:
    root = options.get("store_root")
    if not isinstance(root, str):
        return []
    checks = _Checks("backend")
    path = Path(root)
    if not path.is_absolute():
        checks.add("store root", False, f"{root} is not an absolute path")
        return checks.items
    probe = path if path.exists() else path.parent
    ok = probe.is_dir() and os.access(probe, os.W_OK | os.X_OK)
    checks.add("store root", ok, f"{root} {'is writable' if ok else 'is not a writable directory'}")
    return checks.items


async def run_doctor(args: argparse.Namespace, config: ConfigFile) -> list[DoctorCheck]:
    """Every doctor check for the settings ``args`` and ``config`` resolve to."""
    checks = _Checks("config")
    serving = {"enable_versioned_lora_publication": True}
    try:
        settings = layered_settings(args, config, fallback=serving)
        checks.add("settings", True, "valid")
    except ConfigurationError as exc:
        checks.add("settings", False, one_line(exc.message))
        # Relaxed: only the fleet list must parse, so the engines can still be checked.
        relaxed = {"enable_versioned_lora_publication": False}
        settings = layered_settings(args, config, force=relaxed)
    adapter = None
    if args.adapter is not None:
        adapter = await asyncio.to_thread(AdapterSnapshot.from_peft_dir, args.adapter)
    async with httpx.AsyncClient(trust_env=False, limits=engine_limits()) as client:
        per_engine = await asyncio.gather(
            *(
                _probe_engine(ref, settings, client, adapter)
                for ref in settings.publication_engines  # every PD role server too
            )
        )
    found = list(checks.items)
    for engine_checks in per_engine:
        found.extend(engine_checks)
    found.extend(_router_checks(settings))
    found.extend(_store_checks(config.backend_options))
    return found


async def run(args: argparse.Namespace, out: IO[str]) -> int:
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


COMMAND = Command(
    "doctor",
    Needs.SETTINGS,
    run,
    arguments=(
        argument("--adapter", help="also check this adapter directory fits the engines"),
        argument("--json", action="store_true", help="print the checks as JSON"),
    ),
    help="check every engine against the settings",
    description="Check each engine (reachable, LoRA on with enough slots for the capacity, "
    "served model, max rank) and the router's retry assertion.",
)
