"""Ejection against scripted SGLang engines (respx at the HTTP edge), with the real LocalRegistry,
HTTP push backend, Publisher, Repairer and Sessions.

A hung engine is an engine whose load never answers (an asyncio.Event gate, never set until the
test says so) and whose health probes fail (scripted UNREACHABLE). Time is an injected clock that
only the test moves, and every probe round is one explicit ``probe_once``/``repair_once``: nothing
here depends on how fast anything ran.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentic_lora.assembly.deployment import Deployment
from agentic_lora.assembly.membership import DrainOutcome
from agentic_lora.publication.ejection import ENGINE_EJECTED
from agentic_lora.publication.ejection import Ejections
from agentic_lora.publication.ejection import Ejector
from agentic_lora.publication.result import PublicationOutcome
from agentic_lora.registry.types import MemberState
from agentic_lora.registry.types import RegistryStatus
from agentic_lora.registry.types import VersionState
from agentic_lora.testing.adapters import tiny_snapshot
from agentic_lora.testing.fleet import ScriptedFleet
from agentic_lora.testing.sglang_engine import EngineOp
from agentic_lora.testing.sglang_engine import Fault
from agentic_lora.testing.sglang_engine import FaultKind
from agentic_lora.testing.sglang_engine import ScriptedSGLangEngine

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]

A, B, C = tiny_snapshot(1), tiny_snapshot(2), tiny_snapshot(3)
NO_TICK = 3600.0
EJECT_AFTER = 10.0


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def fleet() -> Iterator[ScriptedFleet]:
    with ScriptedFleet() as fleet:
        yield fleet


@contextlib.asynccontextmanager
async def deployment(
    fleet: ScriptedFleet, root: Path, clock: Clock, gates: list[asyncio.Event]
) -> AsyncIterator[Deployment]:
    d = Deployment.from_settings(
        fleet.settings(probe_interval=NO_TICK, eject_after=EJECT_AFTER),
        backend_options={"store_root": str(root / "store")},
    )
    # The same ejector the Deployment built, on the test's clock.
    d.repairer.ejector = Ejector(d.registry, d.ejections, eject_after=EJECT_AFTER, monotonic=clock)
    async with d:
        try:
            await d.repairer.settled()
            assert (await d.publish("A", A)).ok
            yield d
        finally:
            for gate in gates:
                gate.set()  # a failed assertion must not leave a hung load holding the shutdown


def _hang(engine: ScriptedSGLangEngine, gates: list[asyncio.Event]) -> asyncio.Event:
    """The engine's next load hangs until released; returns the event its arrival sets."""
    gate, reached = asyncio.Event(), asyncio.Event()
    engine.script(EngineOp.LOAD, Fault.waiting_for(gate, reached))
    gates.append(gate)
    return reached


def _probes_fail(engine: ScriptedSGLangEngine, rounds: int) -> None:
    engine.script(EngineOp.SERVER_INFO, *[Fault(FaultKind.UNREACHABLE)] * rounds)


async def _members(d: Deployment) -> dict[str, MemberState]:
    status: RegistryStatus = await d.registry.status()
    return {e.engine: e.membership for e in status.engines}


async def test_a_publication_waiting_on_a_hung_engine_commits_over_the_live_member_once_it_is_ejected(
    fleet: ScriptedFleet, tmp_path: Path
) -> None:
    clock, gates = Clock(), []
    async with deployment(fleet, tmp_path, clock, gates) as d:
        e1 = fleet["e1"]
        reached = _hang(e1, gates)
        publishing = asyncio.create_task(d.publish("B", B))
        await reached.wait()  # B's load on e1 hangs
        _probes_fail(e1, 2)
        await d.repairer.probe_once()  # the first failed round starts the clock at 0
        assert await _members(d) == {"e0": MemberState.ACTIVE, "e1": MemberState.ACTIVE}
        assert not publishing.done()
        clock.t = EJECT_AFTER
        await d.repairer.probe_once()  # failing for eject_after: ejected
        result = await publishing
        assert result.outcome is PublicationOutcome.PUBLISHED
        reports = {r.engine: r for r in result.engines}
        assert reports["e1"].error_code == ENGINE_EJECTED
        assert reports["e0"].error_code is None
        assert await _members(d) == {"e0": MemberState.ACTIVE, "e1": MemberState.EJECTED}
        status = await d.registry.status()
        assert status.default_version == "B"
        # Nothing is routed to the ejected engine, whatever it holds.
        assert (await d.registry.version("A")).ready_engines == ("e0",)
        s = d.versioning.open_session("agent")
        replies = [await s.generate({"text": f"turn {i}"}) for i in range(4)]
        assert {r.engine for r in replies} == {"e0"}


async def test_a_reclaim_hung_on_an_engine_stops_waiting_once_it_is_ejected_so_publish_never_stalls(
    fleet: ScriptedFleet, tmp_path: Path
) -> None:
    clock, gates = Clock(), []
    async with deployment(fleet, tmp_path, clock, gates) as d:
        s = d.versioning.open_session("on-a")
        await s.generate({"text": "turn 0"})
        assert (await d.publish("B", B)).outcome is PublicationOutcome.PUBLISHED
        e1 = fleet["e1"]
        gate, reached = asyncio.Event(), asyncio.Event()
        e1.script(EngineOp.UNLOAD, Fault.waiting_for(gate, reached))
        gates.append(gate)
        await s.close()  # A's last Session: the reclaimer unloads A, and e1's unload hangs
        await reached.wait()
        # Both slots are held (B, and A RECLAIMING): C needs A's, so its publication joins the
        # reclaim hung on e1, and stops waiting once e1 is ejected.
        publishing = asyncio.create_task(d.publish("C", C))
        _probes_fail(e1, 2)
        await d.repairer.probe_once()
        clock.t = EJECT_AFTER
        await d.repairer.probe_once()
        result = await asyncio.wait_for(publishing, 30)  # a hang guard: the gate is never set
        assert result.outcome is PublicationOutcome.SKIPPED
        assert not gate.is_set()
        a = await d.registry.version("A")
        assert a.state is VersionState.RECLAIMING
        assert a.reclaimed_engines == ("e0",)
        # e1 answers again: it holds B, so it rejoins at once; the next publication's reclaim
        # round unloads A from it, frees the slot, and C commits on both members.
        await d.repairer.repair_once()
        assert (await _members(d))["e1"] is MemberState.ACTIVE
        assert (await d.publish("C", C)).outcome is PublicationOutcome.PUBLISHED
        assert (await d.registry.version("A")).state is VersionState.RECLAIMED
        assert not e1.holds(a.lora_name)
        assert (await d.registry.version("C")).ready_engines == ("e0", "e1")


async def test_a_cleanup_never_waits_for_a_hung_engine_once_it_is_ejected(
    fleet: ScriptedFleet, tmp_path: Path
) -> None:
    clock, gates = Clock(), []
    async with deployment(fleet, tmp_path, clock, gates) as d:
        e0, e1 = fleet["e0"], fleet["e1"]
        reached = _hang(e1, gates)  # B's load on e1 hangs ...
        e0.script(EngineOp.LOAD, Fault(FaultKind.REFUSE))  # ... and e0 refuses it: abort, clean
        unload_gate, unload_reached = asyncio.Event(), asyncio.Event()
        e1.script(EngineOp.UNLOAD, Fault.waiting_for(unload_gate, unload_reached))
        gates.append(unload_gate)
        publishing = asyncio.create_task(d.publish("B", B))
        await reached.wait()
        _probes_fail(e1, 2)
        await d.repairer.probe_once()
        clock.t = EJECT_AFTER
        await d.repairer.probe_once()
        result = await asyncio.wait_for(publishing, 30)  # a hang guard: no gate is ever set
        assert result.outcome is PublicationOutcome.BLOCKED
        reports = {r.engine: r for r in result.engines}
        assert reports["e0"].cleaned is True
        assert reports["e1"].cleaned is False
        assert reports["e1"].error_code == ENGINE_EJECTED
        assert not unload_reached.is_set()  # nothing was sent to the ejected engine
        assert (await d.registry.version("B")).state is VersionState.ABORTED
        # e1 answers again: it rejoins (it holds A), and the cleanup is resolved there.
        await d.repairer.repair_once()
        assert (await _members(d))["e1"] is MemberState.ACTIVE
        unload_gate.set()
        assert (await d.resolve("B")).blocked == ()
        assert (await d.registry.version("B")).state is VersionState.FAILED_CLEAN


async def test_an_ejected_engine_rejoins_only_after_repair_loaded_every_dispatchable_version(
    fleet: ScriptedFleet, tmp_path: Path
) -> None:
    clock, gates = Clock(), []
    async with deployment(fleet, tmp_path, clock, gates) as d:
        e1 = fleet["e1"]
        _probes_fail(e1, 2)
        await d.repairer.probe_once()
        clock.t = EJECT_AFTER
        await d.repairer.probe_once()
        assert (await _members(d))["e1"] is MemberState.EJECTED
        assert d.ejections.is_ejected("e1")
        # Published over e0 alone meanwhile: e1 lacks B.
        assert (await d.publish("B", B)).outcome is PublicationOutcome.PUBLISHED
        assert not e1.holds((await d.registry.version("B")).lora_name)
        e1.restart()  # it comes back as a new process holding nothing
        await d.repairer.repair_once()  # observe, load A? no: A has no Session; B is loaded
        await d.repairer.repair_once()  # the repaired engine is activated
        assert (await _members(d))["e1"] is MemberState.ACTIVE
        assert not d.ejections.is_ejected("e1")
        assert e1.holds((await d.registry.version("B")).lora_name)
        assert (await d.registry.version("B")).ready_engines == ("e0", "e1")


async def test_an_engine_failing_probes_for_less_than_the_threshold_stays_a_member(
    fleet: ScriptedFleet, tmp_path: Path
) -> None:
    clock, gates = Clock(), []
    async with deployment(fleet, tmp_path, clock, gates) as d:
        _probes_fail(fleet["e1"], 2)
        await d.repairer.probe_once()
        clock.t = EJECT_AFTER - 1
        await d.repairer.probe_once()
        clock.t = EJECT_AFTER + 1
        await d.repairer.probe_once()  # it answers again: the failing streak is over
        assert (await _members(d))["e1"] is MemberState.ACTIVE


async def test_unless_ejected_answers_the_work_or_stops_waiting_for_it() -> None:
    ejections = Ejections()
    assert await ejections.unless_ejected("e0", asyncio.sleep(0, result=7), lambda: -1) == 7
    never = asyncio.Event()
    waiting: Any = asyncio.create_task(
        ejections.unless_ejected("e1", never.wait(), lambda: "ejected")
    )
    await asyncio.sleep(0)
    ejections.mark("e1", True)
    assert await waiting == "ejected"
    # Already ejected: the work is not waited for at all.
    assert await ejections.unless_ejected("e1", never.wait(), lambda: "ejected") == "ejected"
    assert ejections.is_ejected("e1")
    ejections.mark("e1", False)
    assert not ejections.is_ejected("e1")


async def test_drain_remove_and_add_an_engine_through_the_deployment(
    fleet: ScriptedFleet, tmp_path: Path
) -> None:
    clock, gates = Clock(), []
    async with deployment(fleet, tmp_path, clock, gates) as d:
        s = d.versioning.open_session("before-drain")
        await s.generate({"text": "turn 0"})
        drained = await d.drain_engine("e1", remove=False)
        assert (drained.outcome, drained.membership) == (DrainOutcome.DRAINED, MemberState.DRAINING)
        assert (drained.in_flight_at_drain, drained.in_flight) == (0, 0)
        # No new work on the draining engine; the Session keeps its version on e0.
        replies = [await s.generate({"text": f"turn {i}"}) for i in range(1, 4)]
        assert {r.engine for r in replies} == {"e0"}
        name_a = (await d.registry.version("A")).lora_name
        assert {r.body["meta_info"]["lora_path"] for r in replies} == {name_a}
        assert await d.remove_engine("e1") is MemberState.REMOVED
        assert [e.engine for e in await d.engines()] == ["e0"]
        # Published while e1 is out: it must get B (and A, still bound) before it is routable.
        assert (await d.publish("B", B)).outcome is PublicationOutcome.PUBLISHED
        e1 = fleet["e1"]
        assert not e1.holds((await d.registry.version("B")).lora_name)
        assert await d.add_engine("e1") is MemberState.ACTIVE
        assert e1.holds((await d.registry.version("B")).lora_name)
        assert e1.holds((await d.registry.version("A")).lora_name)
        assert (await d.registry.version("B")).ready_engines == ("e0", "e1")
        # The Session never changed version: still A, on whichever member holds it.
        last = await s.generate({"text": "turn 4"})
        assert last.body["meta_info"]["lora_path"] == name_a
