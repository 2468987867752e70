"""Rollback through :class:`Deployment`: a version that was the default before becomes the default
again without a restart, two-phase, with its exact identity; Sessions bound to the newer version
keep it, new ones bind the rolled-back one. Scripted SGLang engines (respx) at the HTTP edge; the
real registry, publisher, reclaimer and HTTP push backend in between."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from agentic_lora.assembly.deployment import Deployment
from agentic_lora.errors import BackendRefusedError
from agentic_lora.errors import RollbackRefusedError
from agentic_lora.errors import UnknownVersionError
from agentic_lora.errors import VersionConflictError
from agentic_lora.publication.result import PublicationOutcome
from agentic_lora.registry.local import LocalRegistry
from agentic_lora.registry.types import VersionState
from agentic_lora.registry.types import new_request_id
from agentic_lora.session import Session
from agentic_lora.testing.adapters import tiny_snapshot
from agentic_lora.testing.fleet import ScriptedFleet
from agentic_lora.testing.sglang_engine import EngineOp
from agentic_lora.testing.sglang_engine import Fault
from agentic_lora.testing.sglang_engine import FaultKind

pytestmark = pytest.mark.asyncio

A, B, C = tiny_snapshot(1), tiny_snapshot(2), tiny_snapshot(3)
S = VersionState
Out = PublicationOutcome


@contextlib.asynccontextmanager
async def deployed(
    tmp_path: Path, *, started: bool = True, **backend: Any
) -> AsyncIterator[tuple[ScriptedFleet, Deployment]]:
    """A Deployment on two scripted engines; ``started=False`` leaves its background parts
    (reclaimer, repairer) off, so a test decides when anything is reclaimed."""
    with ScriptedFleet() as fleet:
        options = {"store_root": str(tmp_path / "store"), **backend}
        d = Deployment.from_settings(fleet.settings(), backend_options=options)
        try:
            if started:
                await d.start()
            yield fleet, d
        finally:
            await d.aclose()


def state(d: Deployment, version_id: str) -> VersionState | None:
    assert isinstance(d.registry, LocalRegistry)
    return d.registry.state_of(version_id)


def lora_name(d: Deployment, version_id: str) -> str:
    assert isinstance(d.registry, LocalRegistry)
    return d.registry.core.version(version_id).lora_name


def sent(fleet: ScriptedFleet, marker: str) -> set[str]:
    """Every adapter the engines got a generation of Session ``marker`` for."""
    return {
        body["lora_path"]
        for engine in fleet.engines.values()
        for op, body in engine.calls
        if op is EngineOp.GENERATE and str(body.get("text", "")).startswith(marker)
    }


async def turn(s: Session, n: int = 1) -> None:
    await s.generate({"text": f"{s.session_id}: turn {n}", "sampling_params": {}})


async def test_a_rollback_to_a_retired_version_keeps_bound_sessions_and_binds_new_ones(
    tmp_path: Path,
) -> None:
    async with deployed(tmp_path) as (fleet, d):
        await d.publish("A", A)
        on_a = d.versioning.open_session("on-a")
        await turn(on_a)
        await d.publish("B", B)
        on_b = d.versioning.open_session("on-b")
        await turn(on_b)
        loads = fleet.calls(EngineOp.LOAD)

        result = await d.rollback("A")

        assert result.outcome is Out.PUBLISHED
        assert result.commit is not None
        assert (result.commit.rollback, result.commit.previous_default) == (True, "B")
        assert (result.commit.default_revision, result.lora_name) == (3, lora_name(d, "A"))
        assert fleet.calls(EngineOp.LOAD) == loads  # still loaded: nothing transferred
        status = await d.status()
        assert (status.default_version, status.rolled_back_from) == ("A", "B")
        # Sessions keep what they bound; a new one binds A and can tell it is a rollback.
        await turn(on_b, 2)
        await turn(on_a, 2)
        fresh = d.versioning.open_session("fresh")
        await turn(fresh)
        provenance = fresh.provenance()
        assert (provenance["version_id"], provenance["default_revision_at_bind"]) == ("A", 3)
        assert provenance["rolled_back_from"] == "B"
        assert on_b.provenance()["rolled_back_from"] is None
        # B is retired like any superseded default and reclaimed once its Session is gone.
        assert state(d, "B") is S.RETIRED
        await on_b.close()
        await d.reclaimer.settled()
        assert state(d, "B") is S.RECLAIMED
        await on_a.close()
        await fresh.close()
    assert sent(fleet, "on-a") == sent(fleet, "fresh") == {lora_name(d, "A")}
    assert sent(fleet, "on-b") == {lora_name(d, "B")}


async def test_a_replayed_rollback_returns_the_same_receipt(tmp_path: Path) -> None:
    async with deployed(tmp_path) as (_, d):
        await d.publish("A", A)
        await d.publish("B", B)
        first = await d.rollback("A")
        again = await d.rollback("A")
        assert again.outcome is Out.ALREADY_PUBLISHED
        assert again.commit == first.commit
        assert (await d.status()).default_revision == 3


async def test_a_rollback_to_a_reclaimed_version_reloads_it_from_the_store(tmp_path: Path) -> None:
    async with deployed(tmp_path) as (fleet, d):
        await d.publish("A", A)
        await d.publish("B", B)
        await d.reclaimer.settled()
        assert state(d, "A") is S.RECLAIMED
        assert "A" not in d.snapshots  # nothing in memory: the store's reclaimed copy serves
        name = lora_name(d, "A")

        result = await d.rollback("A")

        assert result.outcome is Out.PUBLISHED
        assert result.commit is not None
        assert (result.commit.rollback, result.attempt, result.lora_name) == (True, 2, name)
        for engine in fleet.engines.values():
            assert engine.held_digest(name) == A.digest  # the same name, the same bytes
            assert engine.physical_loads[name] == 2
        async with d.session("after") as s:
            await turn(s)
        await d.reclaimer.settled()
        assert (state(d, "A"), state(d, "B")) == (S.PUBLISHED, S.RECLAIMED)
    assert sent(fleet, "after") == {name}


async def test_a_reload_that_an_engine_refuses_is_cleaned_and_leaves_it_reclaimed(
    tmp_path: Path,
) -> None:
    async with deployed(tmp_path) as (fleet, d):
        await d.publish("A", A)
        await d.publish("B", B)
        await d.reclaimer.settled()
        fleet["e1"].script(EngineOp.LOAD, Fault(FaultKind.REFUSE, "no room"))

        result = await d.rollback("A")

        assert result.outcome is Out.FAILED_CLEAN
        assert "prepare failed" in (result.reason or "")
        status = await d.status()
        assert (status.default_version, status.pending_version) == ("B", None)
        assert (state(d, "A"), status.slots_in_use) == (S.RECLAIMED, 1)
        assert not fleet["e0"].holds(lora_name(d, "A"))  # cleaned where it did load
        # Publishing the same id stays a no-op; the rollback may simply be tried again.
        assert (await d.publish("A", A)).outcome is Out.ALREADY_PUBLISHED
        assert (await d.rollback("A")).outcome is Out.PUBLISHED


async def test_a_reload_beyond_capacity_is_skipped_before_any_transfer(tmp_path: Path) -> None:
    async with deployed(tmp_path) as (fleet, d):
        await d.publish("A", A)
        await d.publish("B", B)
        await d.reclaimer.settled()
        pinned = d.versioning.open_session("pinned")
        await turn(pinned)  # holds B once C is the default
        await d.publish("C", C)
        loads = fleet.calls(EngineOp.LOAD)
        result = await d.rollback("A")
        assert (result.outcome, result.reason) == (Out.SKIPPED, "CAPACITY_ERROR")
        assert fleet.calls(EngineOp.LOAD) == loads
        assert (await d.status()).default_version == "C"
        await pinned.close()


async def test_a_retired_version_is_loaded_back_onto_an_engine_that_restarted(
    tmp_path: Path,
) -> None:
    async with deployed(tmp_path, started=False) as (fleet, d):
        await d.publish("A", A)
        await d.publish("B", B)  # no background reclaimer: A stays RETIRED, held by nobody
        fleet["e1"].restart()  # e1 lost A (and B); nobody repairs a RETIRED version without refs
        name = lora_name(d, "A")

        result = await d.rollback("A")

        assert result.outcome is Out.PUBLISHED
        assert fleet["e1"].held_digest(name) == A.digest
        assert fleet["e1"].physical_loads[name] == 2
        a = await d.registry.version("A")
        assert (a.state, a.attempt, a.ready_engines) == (S.PUBLISHED, 1, ("e0", "e1"))


async def test_a_rollback_finishes_a_running_reclaim_and_reloads(tmp_path: Path) -> None:
    async with deployed(tmp_path, started=False) as (_, d):
        await d.publish("A", A)
        await d.publish("B", B)
        await d.registry.claim_reclaim(request_id=new_request_id(), version_id="A")
        assert state(d, "A") is S.RECLAIMING
        result = await d.rollback("A")
        assert (result.outcome, result.attempt) == (Out.PUBLISHED, 2)


async def test_rollback_refusals_are_typed_and_change_nothing(tmp_path: Path) -> None:
    async with deployed(tmp_path) as (_, d):
        await d.publish("A", A)
        with pytest.raises(RollbackRefusedError) as err:
            await d.rollback("A")
        assert err.value.details["reason"] == "current_default"
        with pytest.raises(UnknownVersionError):
            await d.rollback("never-published")
        assert (await d.status()).default_revision == 1


async def test_a_reclaimed_version_without_stored_content_needs_the_caller_to_give_it(
    tmp_path: Path,
) -> None:
    async with deployed(tmp_path, keep_reclaimed=0) as (fleet, d):
        await d.publish("A", A)
        await d.publish("B", B)
        await d.reclaimer.settled()
        loads = fleet.calls(EngineOp.LOAD)
        with pytest.raises(BackendRefusedError) as err:
            await d.rollback("A")
        assert err.value.details["reason"] == "snapshot_unavailable"
        with pytest.raises(VersionConflictError):
            await d.rollback("A", snapshot=C)  # other content under A's identity: never
        status = await d.status()
        assert (status.default_version, status.pending_version, state(d, "A")) == (
            "B",
            None,
            S.RECLAIMED,
        )
        assert fleet.calls(EngineOp.LOAD) == loads
        result = await d.rollback("A", snapshot=A)
        assert result.outcome is Out.PUBLISHED
