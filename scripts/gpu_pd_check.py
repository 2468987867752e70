"""The scenario of scripts/gpu-pd-check.sh: publication and reclaim on one real PD group.

Run by the shell script once a prefill server, a decode server and the SGLang PD router (retries
off) are healthy. Prints one PASS/FAIL line per check; exit status 0 only if all passed.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

import httpx

from agentic_lora.adapters.snapshot import AdapterSnapshot
from agentic_lora.assembly.deployment import Deployment
from agentic_lora.config import load_settings
from agentic_lora.config import verify_fleet
from agentic_lora.publication.publisher import PublicationOutcome
from agentic_lora.registry.types import VersionState

ROLES = ("g1.prefill", "g1.decode0")


class Report:
    def __init__(self) -> None:
        self.failed = 0

    def check(self, name: str, ok: bool, detail: Any = "") -> bool:
        print(f"{'PASS' if ok else 'FAIL'} {name}{f': {detail}' if detail != '' else ''}")
        self.failed += not ok
        return ok


async def _adapters_on(url: str) -> set[str]:
    async with httpx.AsyncClient(timeout=30) as client:
        cards = (await client.get(url + "/v1/models")).json()["data"]
    return {c["id"] for c in cards if c.get("parent")}


async def run(args: argparse.Namespace) -> int:
    r = Report()
    settings = load_settings(
        enable_versioned_lora_publication=True,
        pd_groups=[f"g1=prefill={args.prefill},decode={args.decode},router={args.router}"],
        gateway_retries_disabled=True,  # the script starts the router with --disable-retries
        capacity=2,
        engine_max_loaded_loras=3,
        engine_max_loras_per_batch=3,
        base_model_name=args.served_model_name,
        probe_interval=2.0,
        http_transport=args.http_transport,
    )
    servers = {"g1.prefill": args.prefill, "g1.decode0": args.decode}
    sampling = {"max_new_tokens": 8, "temperature": 0.0}
    a = AdapterSnapshot.from_peft_dir(args.adapter_a)
    b = AdapterSnapshot.from_peft_dir(args.adapter_b)
    async with Deployment.from_settings(
        settings, backend_options={"store_root": args.store_root}
    ) as d:
        await verify_fleet(settings, d.versioning.transport)
        r.check("start-up check: both role servers have LoRA on, 3 slots, their PD role", True)
        published = await d.publish("A", a)
        r.check("publish A", published.outcome is PublicationOutcome.PUBLISHED, published.reason)
        a_status = await d.registry.version("A")
        r.check("A is READY on every role server", a_status.ready_engines == ROLES)
        for name, url in servers.items():
            r.check(f"{name} holds A", a_status.lora_name in await _adapters_on(url))
        async with d.session("old") as old:
            reply = await old.generate(
                {"text": "The capital of France is", "sampling_params": sampling}
            )
            r.check("a Session on A generates through the PD router", reply.status_code == 200)
            published = await d.publish("B", b)
            r.check(
                "publish B", published.outcome is PublicationOutcome.PUBLISHED, published.reason
            )
            again = await old.generate({"text": "And of Italy?", "sampling_params": sampling})
            r.check(
                "the old Session stays on A after B is the default",
                again.provenance is not None and again.provenance.version_id == "A",
            )
            async with d.session("new") as new:
                fresh = await new.generate({"text": "Hello", "sampling_params": sampling})
                r.check(
                    "a new Session binds B",
                    fresh.provenance is not None and fresh.provenance.version_id == "B",
                )
        report = await d.reclaim()
        await d.reclaimer.settled()
        a_after = await d.registry.version("A")
        r.check(
            "A is reclaimed once its Sessions are gone",
            a_after.state is VersionState.RECLAIMED,
            f"{a_after.state.value}; round: {report.reclaimed}",
        )
        for name, url in servers.items():
            r.check(f"{name} no longer holds A", a_status.lora_name not in await _adapters_on(url))
    print(f"{'PASS' if r.failed == 0 else 'FAIL'} summary: {r.failed} failed check(s)")
    return 0 if r.failed == 0 else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    for flag in ("--prefill", "--decode", "--router", "--served-model-name"):
        parser.add_argument(flag, required=True)
    for flag in ("--adapter-a", "--adapter-b", "--store-root"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--http-transport", choices=["aiohttp", "httpx"], default="aiohttp")
    try:
        return asyncio.run(run(parser.parse_args()))
    except Exception as exc:  # one FAIL line, not a traceback, for an operator reading the output
        print(f"FAIL scenario stopped: {type(exc).__name__}: {exc}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
