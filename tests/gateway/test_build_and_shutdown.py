"""Building, stopping and unblocking a gateway: settings checked before anything runs, a journal
that is not a database, the metrics route without metrics, shutdown with a publication in flight,
and the admin route that resolves a publication blocking a slot.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from agentic_lora.errors import ConfigurationError
from agentic_lora.errors import JournalCorruptError
from agentic_lora.gateway.app import Gateway
from agentic_lora.testing.fleet import ScriptedFleet
from agentic_lora.testing.sglang_engine import EngineOp
from agentic_lora.testing.sglang_engine import Fault
from agentic_lora.testing.sglang_engine import FaultKind
from tests.gateway.test_gateway import ADMIN_TOKEN
from tests.gateway.test_gateway import gateway_stack
from tests.gateway.test_gateway import settings_for

pytestmark = pytest.mark.asyncio

ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}


async def test_gateway_settings_are_checked_before_anything_runs(tmp_path: Path) -> None:
    with ScriptedFleet() as fleet:
        with pytest.raises(ConfigurationError) as off:
            await Gateway.from_settings(
                settings_for(fleet, enable_versioned_lora_publication=False),
                backend_options={"store_root": str(tmp_path / "store")},
            )
        assert off.value.details["check"] == "flag"
        assert "--enable-versioned-lora-publication" in off.value.message

        async with gateway_stack(tmp_path) as stack:
            deployment = stack.gateway.deployment
            for options, check in (
                ({"idle_timeout": 0}, "idle_timeout"),
                ({"idle_timeout": -1.0}, "idle_timeout"),
                ({"admin_token": "   "}, "admin_token"),
            ):
                with pytest.raises(ConfigurationError) as bad:
                    Gateway(deployment, **options)
                assert bad.value.details["check"] == check
        # Only the stack's own start-up probes (incarnation reads) reached the engines: a refused
        # build loaded, generated and unloaded nothing.
        for op in (EngineOp.LOAD, EngineOp.GENERATE, EngineOp.UNLOAD):
            assert fleet.calls(op) == 0


async def test_a_journal_that_is_not_a_database_fails_the_build_with_a_typed_error(
    tmp_path: Path,
) -> None:
    journal = tmp_path / "journal.sqlite"
    journal.write_bytes(b"this is not a registry journal" * 64)
    before = journal.read_bytes()
    with ScriptedFleet() as fleet:
        with pytest.raises(JournalCorruptError) as err:
            await Gateway.from_settings(
                settings_for(fleet, journal_path=str(journal)),
                backend_options={"store_root": str(tmp_path / "store")},
            )
        assert fleet.calls() == 0
    assert err.value.code == "JOURNAL_CORRUPT"
    assert "is not a readable SQLite database" in err.value.message
    assert journal.read_bytes() == before  # never overwritten


async def test_without_metrics_the_metrics_route_is_a_typed_404(tmp_path: Path) -> None:
    async with gateway_stack(tmp_path, with_metrics=False) as stack:
        assert stack.gateway.metrics is None
        response = await stack.http().get("/metrics")
        assert response.status_code == 404
        assert response.json()["error"] == {
            "code": "CONFIG_ERROR",
            "message": "this gateway runs without metrics",
            "details": {"check": "metrics"},
        }


# --- shutdown -----------------------------------------------------------------------------------


async def test_closing_the_gateway_lets_a_running_publication_finish(tmp_path: Path) -> None:
    async with gateway_stack(tmp_path) as stack:
        gate, reached = asyncio.Event(), asyncio.Event()
        stack.fleet["e1"].script(EngineOp.LOAD, Fault.waiting_for(gate, reached))
        publishing = asyncio.ensure_future(stack.publish("A", 1))
        await reached.wait()  # e1 holds the load: the publication is mid-flight

        closing = asyncio.ensure_future(stack.gateway.aclose())
        await asyncio.sleep(0)  # aclose runs up to its wait for the publication
        assert not closing.done()
        gate.set()
        await closing
        result = await publishing
        assert result["outcome"] == "PUBLISHED"
        name = result["lora_name"]
        assert all(e.holds(name) for e in stack.fleet.engines.values())


# --- resolving a blocked publication -----------------------------------------------------------


async def test_the_resolve_route_needs_the_admin_token_and_frees_a_blocked_slot(
    tmp_path: Path,
) -> None:
    async with gateway_stack(tmp_path) as stack:
        # The route is what is tested: the background resolver would settle B on its own.
        await stack.gateway.deployment.resolver.stop()
        await stack.publish("A", 1)
        stack.fleet["e1"].script(EngineOp.LOAD, Fault(FaultKind.REFUSE, "no room"))
        stack.fleet["e0"].script(EngineOp.UNLOAD, Fault(FaultKind.UNREACHABLE))
        assert (await stack.publish("B", 2))["outcome"] == "BLOCKED"
        registry: Any = stack.gateway.deployment.registry
        http = stack.http()
        unloads = stack.fleet.calls(EngineOp.UNLOAD)
        for headers in ({}, {"authorization": "Bearer wrong"}):
            denied = await http.post("/admin/resolve", json={"version_id": "B"}, headers=headers)
            assert denied.status_code == 401
            assert denied.json()["error"]["code"] == "ACCESS_DENIED"
        empty_id = await http.post("/admin/resolve", json={"version_id": " "}, headers=ADMIN)
        assert empty_id.status_code == 400
        assert empty_id.json()["error"]["details"]["field"] == "version_id"
        unknown = await http.post("/admin/resolve", json={"version_id": "nope"}, headers=ADMIN)
        assert unknown.status_code == 404
        assert unknown.json()["error"]["code"] == "UNKNOWN_VERSION"
        assert stack.fleet.calls(EngineOp.UNLOAD) == unloads
        assert registry.peek_version("B").state.value == "ABORTED"

        answer = await http.post("/admin/resolve", json={"version_id": "B"}, headers=ADMIN)
        assert answer.status_code == 200
        body = answer.json()
        assert (body["resolved"], body["blocked"]) == (["B"], [])
        (result,) = body["results"]
        assert (result["version_id"], result["outcome"], result["ok"]) == (
            "B",
            "FAILED_CLEAN",
            False,
        )
        # e1 confirmed during the publication; only e0 was left, and it answered now.
        assert [(e["engine"], e["cleaned"]) for e in result["engines"]] == [("e0", True)]
        assert registry.peek_version("B").state.value == "FAILED_CLEAN"

        # Without a version (no body at all) everything blocked is resolved: nothing now.
        everything = await http.post("/admin/resolve", headers=ADMIN)
        assert everything.json() == {"results": [], "resolved": [], "blocked": []}
        again = await stack.admin().resolve("B")
        assert again["results"][0]["reason"] == "nothing to resolve: FAILED_CLEAN"
        assert (await stack.publish("C", 3))["outcome"] == "PUBLISHED"
