"""Engine repair against scripted SGLang engines (respx at the HTTP edge), with the real
LocalRegistry, HTTP push backend, Publisher, Reclaimer, Repairer, Sessions and gateway.

Every race is held open with an asyncio.Event gate on the engine's ``/load_lora_adapter`` (the
scripted engine waits for it), so "while A is being loaded onto the restarted engine" lasts
exactly as long as the test needs; nothing here depends on which of two things finishes first.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import shutil
from collections.abc import AsyncIterator
from collections.abc import Awaitable
from collections.abc import Callable
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from agentic_lora_http import HttpPushBackend
from tenacity import wait_none

from agentic_lora.adapters.store import AdapterStore
from agentic_lora.assembly.deployment import Deployment
from agentic_lora.config import add_arguments
from agentic_lora.config import from_args
from agentic_lora.config import load_settings
from agentic_lora.engines.backends import EngineRef
from agentic_lora.engines.routing import EngineHealth
from agentic_lora.errors import ConfigurationError
from agentic_lora.errors import JournalError
from agentic_lora.errors import RequestRefusedError
from agentic_lora.errors import VersionConflictError
from agentic_lora.errors import VersionUnavailableError
from agentic_lora.gateway.app import Gateway
from agentic_lora.publication.publisher import Phase
from agentic_lora.publication.publisher import PhaseEvent
from agentic_lora.publication.publisher import PhaseStatus
from agentic_lora.publication.publisher import Publisher
from agentic_lora.publication.publisher import RegistryRetry
from agentic_lora.publication.reclaimer import Reclaimer
from agentic_lora.publication.reclaimer import ReclaimOutcome
from agentic_lora.publication.repair import SNAPSHOT_UNAVAILABLE
from agentic_lora.publication.repair import Repairer
from agentic_lora.publication.repair import RepairOutcome
from agentic_lora.publication.repair import SnapshotCache
from agentic_lora.publication.repair import VersionLocks
from agentic_lora.publication.repair import repairable
from agentic_lora.registry.local import LocalRegistry
from agentic_lora.registry.ray_actor import RayRegistryClient
from agentic_lora.registry.ray_actor import RegistryActor
from agentic_lora.registry.types import ReadyReceipt
from agentic_lora.registry.types import RegistryStatus
from agentic_lora.registry.types import VersionState
from agentic_lora.registry.types import VersionStatus
from agentic_lora.registry.types import new_request_id
from agentic_lora.session import Session
from agentic_lora.testing.adapters import tiny_snapshot
from agentic_lora.testing.fleet import ScriptedFleet
from agentic_lora.testing.publish import publish_by_verbs
from agentic_lora.testing.sglang_engine import EngineOp
from agentic_lora.testing.sglang_engine import Fault
from agentic_lora.testing.sglang_engine import FaultKind
from agentic_lora.testing.sglang_engine import ScriptedSGLangEngine
from tests.e2e.support import open_on
from tests.session_support import RecordingRegistry

# A failing assertion must not leave a gated load holding the Deployment's shutdown forever.
pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]

A, B, C = tiny_snapshot(1), tiny_snapshot(2), tiny_snapshot(3)
#: Long enough that no test ever sees a tick: every round here is the start-up one or a poke.
NO_TICK = 3600.0


def _settings(fleet: ScriptedFleet, **kw: Any) -> Any:
    return fleet.settings(**{"probe_interval": NO_TICK, **kw})


@contextlib.asynccontextmanager
async def deployment(fleet: ScriptedFleet, root: Path, **kw: Any) -> AsyncIterator[Deployment]:
    """A started Deployment whose start-up probe has finished."""
    d = Deployment.from_settings(
        _settings(fleet, **kw), backend_options={"store_root": str(root / "store")}
    )
    async with d:
        try:
            await d.repairer.settled()
            yield d
        finally:
            # A test that failed while holding a load must not hold the shutdown with it.
            for gate in _OPEN_GATES:
                gate.set()
            _OPEN_GATES.clear()


@pytest.fixture
def fleet() -> Iterator[ScriptedFleet]:
    with ScriptedFleet() as fleet:
        yield fleet


@pytest_asyncio.fixture
async def d(fleet: ScriptedFleet, tmp_path: Path) -> AsyncIterator[Deployment]:
    """The common start: a started :func:`deployment` on the default settings, A published."""
    async with deployment(fleet, tmp_path) as d:
        assert (await d.publish("A", A)).ok
        yield d


def _status(d: Deployment, version_id: str) -> VersionStatus:
    status = d.registry.peek_version(version_id)  # type: ignore[attr-defined]
    assert isinstance(status, VersionStatus)
    return status


_OPEN_GATES: list[asyncio.Event] = []


def _gate(engine: ScriptedSGLangEngine) -> tuple[asyncio.Event, asyncio.Event]:
    """Hold the engine's next load until the first event is set; the second says it arrived."""
    gate, reached = asyncio.Event(), asyncio.Event()
    engine.script(EngineOp.LOAD, Fault.waiting_for(gate, reached))
    _OPEN_GATES.append(gate)
    return gate, reached


def _ops(engine: ScriptedSGLangEngine, since: int, lora_name: str) -> list[EngineOp]:
    """The engine's calls after index ``since`` that name ``lora_name``, in order."""
    return [
        op
        for op, body in engine.calls[since:]
        if lora_name in (body.get("lora_name"), body.get("lora_path"))
    ]


# --- the measured bug ----------------------------------------------------------------------------


async def test_a_restarted_engine_gets_no_request_for_a_until_a_is_loaded_on_it_again(
    fleet: ScriptedFleet, d: Deployment
) -> None:
    """8 Sessions on A, 4 of them with affinity to e1; e1 restarts (no adapters): before, their
    12 later turns were all 400s and A never came back. Now: they run on e0 while A is loaded
    onto e1 again, e1 sees no request for A before that load, and then they return to e1."""
    name_a = _status(d, "A").lora_name
    homes = {
        e: [await open_on(d.versioning, e, f"{e}-{i}") for i in range(4)] for e in fleet.engines
    }
    sessions = [s for group in homes.values() for s in group]
    first = await asyncio.gather(*(s.generate({"text": "turn 0"}) for s in sessions))
    assert [r.engine for r in first] == ["e0"] * 4 + ["e1"] * 4

    e1 = fleet["e1"]
    e1.restart()
    since = len(e1.calls)
    gate, reached = _gate(e1)
    d.repairer.poke()  # the probe tick
    await reached.wait()
    # The registry knows e1 lost A: it is no longer a holder, so nothing is routed there.
    assert _status(d, "A").ready_engines == ("e0",)
    for turn in range(1, 13):
        replies = await asyncio.gather(*(s.generate({"text": f"turn {turn}"}) for s in sessions))
        assert {r.engine for r in replies} == {"e0"}
        assert {r.body["meta_info"]["lora_path"] for r in replies} == {name_a}
    assert _ops(e1, since, name_a) == [EngineOp.LOAD]  # only the held load itself

    gate.set()
    await d.repairer.settled()
    assert _status(d, "A").ready_engines == ("e0", "e1")
    assert e1.holds(name_a)
    back = await asyncio.gather(*(s.generate({"text": "turn 13"}) for s in homes["e1"]))
    assert {r.engine for r in back} == {"e1"}
    # On e1: the load, then its probe, then the Sessions' turns; never a turn before it.
    ops = _ops(e1, since, name_a)
    assert ops[0] is EngineOp.LOAD
    assert ops.count(EngineOp.GENERATE) == 1 + 4  # the backend's probe, one turn each
    assert e1.implicit_reloads[name_a] == 0
    assert d.repairer.outcomes[RepairOutcome.REPAIRED] == 1


async def test_with_every_holder_restarted_a_dispatch_is_refused_as_unavailable_and_sent_nowhere(
    fleet: ScriptedFleet, d: Deployment
) -> None:
    s = d.versioning.open_session("agent")
    await s.generate({"text": "turn 0"})
    gates = {}
    for name, engine in fleet.engines.items():
        engine.restart()
        gates[name] = _gate(engine)
    d.repairer.poke()
    for _, reached in gates.values():
        await reached.wait()
    sent = fleet.calls(EngineOp.GENERATE)
    with pytest.raises(VersionUnavailableError) as err:
        await s.generate({"text": "turn 1"})
    assert err.value.code == "VERSION_UNAVAILABLE"
    assert isinstance(err.value, RequestRefusedError)  # refused: nothing was sent
    assert err.value.details["lacking"] == ["e0", "e1"]
    assert err.value.details["holders"] == []
    assert err.value.details["version"] == "A"
    assert fleet.calls(EngineOp.GENERATE) == sent
    for gate, _ in gates.values():
        gate.set()
    await d.repairer.settled()
    assert (await s.generate({"text": "turn 2"})).status_code == 200


async def test_a_refused_dispatch_pokes_the_repair_without_waiting_for_a_probe_tick(
    fleet: ScriptedFleet, d: Deployment
) -> None:
    s = await open_on(d.versioning, "e1", "agent")
    await s.generate({"text": "turn 0"})
    rounds = d.repairer.rounds
    fleet["e1"].restart()  # nobody probes: the interval is an hour
    with pytest.raises(RequestRefusedError) as err:
        await s.generate({"text": "turn 1"})
    # The engine's own 400 for an adapter it never loaded: that is the detection.
    assert err.value.details["status"] == 400
    assert not isinstance(err.value, VersionUnavailableError)
    await d.repairer.settled()
    assert d.repairer.rounds > rounds
    assert _status(d, "A").ready_engines == ("e0", "e1")
    assert (await s.generate({"text": "turn 2"})).engine == "e1"


async def test_an_engine_that_does_not_answer_is_routed_around_until_it_answers_again(
    fleet: ScriptedFleet, d: Deployment
) -> None:
    s = await open_on(d.versioning, "e1", "agent")
    await s.generate({"text": "turn 0"})
    d.versioning.health.mark_unhealthy("e0")  # an operator's mark
    fleet["e1"].script(EngineOp.SERVER_INFO, Fault(FaultKind.UNREACHABLE))
    d.repairer.poke()
    await d.repairer.settled()
    assert not d.versioning.health.is_healthy("e1")
    assert d.repairer.ready_engines == ("e0",)
    with pytest.raises(RequestRefusedError, match="no healthy engine"):
        await s.generate({"text": "turn 1"})
    d.versioning.health.mark_healthy("e0")
    assert (await s.generate({"text": "turn 2"})).engine == "e0"
    d.versioning.health.mark_unhealthy("e0")
    d.repairer.poke()
    await d.repairer.settled()
    # e1 answers again and is routed to again; the operator's mark on e0 stands.
    assert d.versioning.health.healthy() == ("e1",)
    assert (await s.generate({"text": "turn 3"})).engine == "e1"


# --- repair vs reclaim ---------------------------------------------------------------------------


async def _retired_a_lacking_e1(d: Deployment, fleet: ScriptedFleet) -> Session:
    """A RETIRED and held by one Session, B the default; e1 restarted before B, so it holds B
    (the publisher loaded it) but not A."""
    assert (await d.publish("A", A)).ok
    s = await open_on(d.versioning, "e0", "holder")
    await s.generate({"text": "turn 0"})
    fleet["e1"].restart()
    assert (await d.publish("B", B)).ok
    a = _status(d, "A")
    assert (a.state, a.session_refs, a.ready_engines) == (VersionState.RETIRED, 1, ("e0",))
    return s


async def test_a_repair_racing_a_reclaim_never_leaves_a_loaded_after_it_is_reclaimed(
    tmp_path: Path,
) -> None:
    with ScriptedFleet() as fleet:
        async with deployment(fleet, tmp_path) as d:
            s = await _retired_a_lacking_e1(d, fleet)
            name_a = _status(d, "A").lora_name
            e1 = fleet["e1"]
            since = len(e1.calls)
            gate, reached = _gate(e1)
            d.repairer.poke()
            await reached.wait()  # A is being loaded onto e1, under A's lock
            await s.close()  # the last Session of A: the reclaim may start
            reclaim = asyncio.create_task(d.reclaimer.reclaim_version("A"))
            for _ in range(100):
                if d.reclaimer.version_locks.contenders("A") == 2:
                    break
                await asyncio.sleep(0)
            # The reclaim waits for the repair: A is not claimed while its load is in flight.
            assert d.reclaimer.version_locks.contenders("A") == 2
            assert _status(d, "A").state is VersionState.RETIRED
            gate.set()
            result = await reclaim
            await d.repairer.settled()
            assert result.outcome is ReclaimOutcome.RECLAIMED
            assert _status(d, "A").state is VersionState.RECLAIMED
            assert not any(engine.holds(name_a) for engine in fleet.engines.values())
            # The repair recorded its READY before the claim; the reclaim's unload removed it.
            assert _ops(e1, since, name_a) == [EngineOp.LOAD, EngineOp.GENERATE, EngineOp.UNLOAD]
            assert d.repairer.outcomes[RepairOutcome.REPAIRED] == 1
            assert d.repairer.outcomes[RepairOutcome.STALE] == 0
            assert "A" not in d.snapshots  # reclaimed: its content is never needed again


@pytest.mark.parametrize("unload_fails", [False, True])
async def test_a_repair_whose_ready_is_refused_removes_what_it_loaded(
    tmp_path: Path, unload_fails: bool
) -> None:
    """Another process's reclaimer claims A (no shared lock across processes) while A is being
    loaded onto e1: the READY does not count (INVALID_STATE) and the copy is cleaned up; a
    cleanup that is not confirmed is reported as such (the reclaim's unload still covers e1)."""
    with ScriptedFleet() as fleet:
        async with deployment(fleet, tmp_path) as d:
            s = await _retired_a_lacking_e1(d, fleet)
            name_a = _status(d, "A").lora_name
            registry: LocalRegistry = d.registry  # type: ignore[assignment]
            e1 = fleet["e1"]
            since = len(e1.calls)
            gate, reached = _gate(e1)
            await d.reclaimer.stop()  # this process's reclaimer stays out of it
            await d.repairer.stop()  # rounds by hand only
            repair = asyncio.create_task(d.repairer.repair_once())
            await reached.wait()
            # The other process: the last Session ends, A is claimed for reclaim.
            await registry.begin_close(request_id=new_request_id(), session_key=s.key)
            await registry.release(request_id=new_request_id(), session_key=s.key)
            await registry.claim_reclaim(request_id=new_request_id(), version_id="A")
            if unload_fails:
                e1.script(EngineOp.UNLOAD, Fault(FaultKind.SERVER_ERROR))
            gate.set()
            report = await repair
            (result,) = [r for r in report.results if r.version_id == "A"]
            assert result.engine == "e1"
            assert result.error_code == "INVALID_STATE"
            if unload_fails:
                assert (result.outcome, result.cleaned) == (
                    RepairOutcome.CLEANUP_UNCONFIRMED,
                    False,
                )
                await s.close()
                return
            assert (result.outcome, result.cleaned) == (RepairOutcome.STALE, True)
            assert not e1.holds(name_a)
            assert _ops(e1, since, name_a) == [EngineOp.LOAD, EngineOp.GENERATE, EngineOp.UNLOAD]
            assert _status(d, "A").state is VersionState.RECLAIMING
            assert "e1" not in _status(d, "A").ready_engines
            await s.close()


async def test_a_repair_that_waited_for_a_reclaim_loads_nothing(tmp_path: Path) -> None:
    """A repair scheduled while A was still held, whose lock was taken by a reclaim that claimed A:
    its re-read under the lock finds RECLAIMING, and nothing is loaded."""
    with ScriptedFleet() as fleet:
        async with deployment(fleet, tmp_path) as d:
            s = await _retired_a_lacking_e1(d, fleet)
            await d.repairer.stop()  # rounds by hand only
            await d.reclaimer.stop()
            locks = d.reclaimer.version_locks
            loads = fleet["e1"].count(EngineOp.LOAD)
            async with locks.hold("A"):  # the reclaim's claim, in flight
                repair = asyncio.create_task(d.repairer.repair_once())
                for _ in range(100):
                    if locks.contenders("A") == 2:
                        break
                    await asyncio.sleep(0)
                assert locks.contenders("A") == 2  # the repair of A waits for the claim
                await s.close()
                await d.registry.claim_reclaim(request_id=new_request_id(), version_id="A")
            report = await repair
            assert report.results == ()
            assert fleet["e1"].count(EngineOp.LOAD) == loads


async def test_stopping_the_repairer_lets_a_running_load_finish_and_record(
    fleet: ScriptedFleet, d: Deployment
) -> None:
    fleet["e1"].restart()
    gate, reached = _gate(fleet["e1"])
    d.repairer.poke()
    await reached.wait()
    stopping = asyncio.create_task(d.repairer.stop())
    for _ in range(10):
        await asyncio.sleep(0)
    assert not stopping.done()  # it waits for the load rather than cut it off
    gate.set()
    await stopping
    assert _status(d, "A").ready_engines == ("e0", "e1")


async def test_an_engine_restarting_again_mid_repair_is_repaired_anew_without_a_cleanup(
    fleet: ScriptedFleet, d: Deployment
) -> None:
    """The READY carries the incarnation read before the load; the engine restarts again while
    the load waits (the load then lands on the new process). The registry refuses it with
    ENGINE_RESTARTED; A is still dispatchable, so the copy is not cleaned (that would fence the
    committed attempt) and the next round records it without loading it twice."""
    name_a = _status(d, "A").lora_name
    await d.repairer.stop()  # rounds by hand only
    e1 = fleet["e1"]
    e1.restart()
    gate, reached = _gate(e1)
    repair = asyncio.create_task(d.repairer.repair_once())
    await reached.wait()
    e1.restart()
    probe = await d.repairer.probe_once()  # the registry learns the newest incarnation
    assert probe.restarted == ("e1",)
    gate.set()
    report = await repair
    (result,) = report.results
    assert (result.outcome, result.error_code) == (RepairOutcome.STALE, "ENGINE_RESTARTED")
    assert result.cleaned is None
    assert e1.holds(name_a)  # on the new process, unrecorded, so never routed to
    assert "e1" not in _status(d, "A").ready_engines
    loads = e1.physical_loads[name_a]
    again = await d.repairer.repair_once()
    assert again.repaired == (("A", "e1"),)
    assert e1.physical_loads[name_a] == loads
    assert e1.count(EngineOp.UNLOAD) == 0


async def test_retired_versions_are_repaired_only_while_sessions_hold_them(tmp_path: Path) -> None:
    with ScriptedFleet() as fleet:
        for engine in fleet.engines.values():
            engine.max_loras_per_batch = 4
        async with deployment(
            fleet, tmp_path, capacity=3, engine_max_loaded_loras=4, engine_max_loras_per_batch=4
        ) as d:
            await d.reclaimer.stop()  # B stays RETIRED without refs: the reclaimer's, not ours
            await d.repairer.stop()  # rounds by hand only
            assert (await d.publish("A", A)).ok
            s = d.versioning.open_session("holder")
            await s.generate({"text": "turn 0"})
            assert (await d.publish("B", B)).ok
            assert (await d.publish("C", C)).ok
            states = {v: (_status(d, v).state, _status(d, v).session_refs) for v in "ABC"}
            assert states == {
                "A": (VersionState.RETIRED, 1),
                "B": (VersionState.RETIRED, 0),
                "C": (VersionState.PUBLISHED, 0),
            }
            e1 = fleet["e1"]
            e1.restart()
            report = await d.repairer.repair_once()
            assert report.restarted == ("e1",)
            assert sorted(report.repaired) == [("A", "e1"), ("C", "e1")]
            assert e1.holds(_status(d, "A").lora_name)
            assert e1.holds(_status(d, "C").lora_name)
            assert not e1.holds(_status(d, "B").lora_name)
            assert "e1" not in _status(d, "B").ready_engines
            await s.close()


async def test_a_loading_version_is_left_to_its_publisher(tmp_path: Path) -> None:
    with ScriptedFleet() as fleet:
        async with deployment(fleet, tmp_path) as d:
            await d.repairer.stop()  # rounds by hand only
            assert (await d.publish("A", A)).ok
            e0_ready = asyncio.Event()

            def on_change(verb: str, result: Any) -> None:
                if (
                    verb == "record_ready"
                    and isinstance(result, VersionStatus)
                    and result.version_id == "B"
                    and "e0" in result.ready_engines
                ):
                    e0_ready.set()

            d.registry.add_listener(on_change)  # type: ignore[attr-defined]
            gate, reached = _gate(fleet["e1"])
            publication = asyncio.create_task(d.publish("B", B))
            await reached.wait()  # B is LOADING: e1's load is held
            await e0_ready.wait()  # and e0's READY is recorded
            fleet["e0"].restart()
            report = await d.repairer.repair_once()
            # A is repaired on e0; B is not touched: its publisher's check before commit sees
            # that e0 restarted and cleans the attempt, as it always did.
            assert report.repaired == (("A", "e0"),)
            assert _status(d, "B").state is VersionState.LOADING
            gate.set()
            result = await publication
            assert not result.ok
            assert _status(d, "A").state is VersionState.PUBLISHED


# --- where the content comes from ----------------------------------------------------------------


async def test_a_restarted_publisher_repairs_from_the_backends_store(tmp_path: Path) -> None:
    journal = tmp_path / "registry.sqlite"
    with ScriptedFleet() as fleet:
        async with deployment(fleet, tmp_path, journal_path=journal) as first:
            assert (await first.publish("A", A)).ok
            assert "A" in first.snapshots
        # A new process: nothing cached, the journal and the store survive; e1 restarts. The
        # start-up probe (awaited by the fixture) sees it and repairs A from the store.
        fleet["e1"].restart()
        async with deployment(fleet, tmp_path, journal_path=journal) as second:
            assert len(second.snapshots) == 0
            assert second.repairer.outcomes[RepairOutcome.REPAIRED] == 1
            assert _status(second, "A").ready_engines == ("e0", "e1")
            assert fleet["e1"].held_digest(_status(second, "A").lora_name) == A.digest


async def test_a_version_whose_content_is_gone_is_reported_and_its_sessions_use_other_holders(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    events: list[PhaseEvent] = []
    with ScriptedFleet() as fleet:
        settings = _settings(fleet)
        d = Deployment.from_settings(
            settings,
            backend_options={"store_root": str(tmp_path / "store")},
            on_progress=events.append,
        )
        async with d:
            await d.repairer.settled()
            await d.repairer.stop()  # rounds by hand only
            assert (await d.publish("A", A)).ok
            s = await open_on(d.versioning, "e1", "agent")
            await s.generate({"text": "turn 0"})
            d.snapshots.evict("A")
            shutil.rmtree(tmp_path / "store")  # and no store copy either
            fleet["e1"].restart()
            caplog.set_level(logging.WARNING, logger="agentic_lora.publication.repair")
            for _ in range(2):
                report = await d.repairer.repair_once()
                (result,) = report.results
                assert result.outcome is RepairOutcome.SNAPSHOT_UNAVAILABLE
            assert d.repairer.outcomes[RepairOutcome.SNAPSHOT_UNAVAILABLE] == 2
            # Reported once (log and progress event), not once per round.
            warned = [r for r in caplog.records if getattr(r, "version", None) == "A"]
            assert [(r.levelno, r.engines) for r in warned] == [(logging.WARNING, ["e1"])]  # type: ignore[attr-defined]
            reported = [e for e in events if e.error_code == SNAPSHOT_UNAVAILABLE]
            assert reported == [
                PhaseEvent("e1", Phase.PREPARE, PhaseStatus.FAILED, 0.0, SNAPSHOT_UNAVAILABLE, "A")
            ]
            assert (await s.generate({"text": "turn 1"})).engine == "e0"


async def test_the_snapshot_cache_keys_content_by_version_and_prunes_what_no_repair_needs(
    tmp_path: Path,
) -> None:
    def status(*versions: VersionStatus) -> RegistryStatus:
        return RegistryStatus(0, 2, (), None, 0, 0, None, versions)

    def version(vid: str, digest: str, state: VersionState) -> VersionStatus:
        return VersionStatus(vid, digest, f"lora-{vid}", state, 1, 0)

    cache = SnapshotCache()
    with cache.publishing("A", A):
        cache.put("B", B)
        cache.put("C", C)
        cache.put("D", tiny_snapshot(4))
        cache.put("E", tiny_snapshot(5))
        dropped = cache.prune(
            status(
                version("B", B.digest, VersionState.RECLAIMED),
                version("C", "f" * 64, VersionState.PUBLISHED),  # the id names other content
                version("D", tiny_snapshot(4).digest, VersionState.RETIRED),
            )
        )
        # A is being published (not reserved yet) and stays; E was never reserved and goes.
        assert dropped == 3
        assert ("A" in cache, "D" in cache, len(cache)) == (True, True, 2)
    assert cache.prune(status()) == 2
    assert not cache.evict("A")
    # A status read before a publication reserved its version must not cost it its snapshot.
    mark = cache.mark()
    with cache.publishing("F", tiny_snapshot(6)):
        pass  # published (and its status read) after the mark
    assert cache.prune(status(), since=mark) == 0
    assert cache.prune(status(), since=cache.mark()) == 1
    with pytest.raises(Exception, match="neither cached nor stored") as err:
        await cache.snapshot(version("A", A.digest, VersionState.PUBLISHED))
    assert err.value.details["reason"] == "snapshot_unavailable"  # type: ignore[attr-defined]

    async def stored(lora_name: str, digest: str) -> Any:
        return B if lora_name == "lora-B" else None

    fallback = SnapshotCache(stored=stored)
    fallback.put("A", B)  # a conflicting publication under A's id: never served for A
    with pytest.raises(Exception, match="neither cached nor stored"):
        await fallback.snapshot(version("A", A.digest, VersionState.PUBLISHED))
    assert await fallback.snapshot(version("B", B.digest, VersionState.PUBLISHED)) is B
    with pytest.raises(Exception, match="hashes to") as mismatch:
        await fallback.snapshot(version("B", A.digest, VersionState.PUBLISHED))
    assert mismatch.value.details["reason"] == "snapshot_mismatch"  # type: ignore[attr-defined]


async def test_the_store_rebuilds_a_snapshot_only_from_a_verified_copy(tmp_path: Path) -> None:
    backend = HttpPushBackend(tmp_path / "store")
    try:
        store = AdapterStore(tmp_path / "store" / "e1")
        path = await store.put("lora-A", A)
        assert (await store.read("lora-A", A.digest)).digest == A.digest
        assert await backend.stored_snapshot("lora-A", A.digest) == A
        assert await backend.stored_snapshot("lora-A", B.digest) is None  # other content
        assert await backend.stored_snapshot("lora-B", B.digest) is None  # never stored
        (path / "adapter_model.safetensors").write_bytes(b"not weights")
        with pytest.raises(VersionConflictError):
            store.read_sync("lora-A", A.digest)
        assert await backend.stored_snapshot("lora-A", A.digest) is None
        (tmp_path / "store" / "not an engine").mkdir()
        assert await HttpPushBackend(tmp_path / "missing").stored_snapshot("x", A.digest) is None
    finally:
        await backend.aclose()


# --- readiness -----------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def gateway(
    fleet: ScriptedFleet, root: Path, **kw: Any
) -> AsyncIterator[tuple[Gateway, httpx.AsyncClient]]:
    """A started gateway over the fleet (its start-up probe done) and an in-process client."""
    gw = await Gateway.from_settings(
        _settings(fleet, **kw), backend_options={"store_root": str(root / "store")}
    )
    async with gw:
        await gw.deployment.repairer.settled()
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=gw.app), base_url="http://gateway"
        ) as client:
            yield gw, client


async def test_readiness_is_false_once_the_registry_journal_fail_stopped(tmp_path: Path) -> None:
    with ScriptedFleet() as fleet:
        async with gateway(fleet, tmp_path, journal_path=tmp_path / "j.sqlite") as (gw, http):
            ready = await http.get("/health/ready")
            assert ready.status_code == 200
            assert ready.json() == {
                "status": "ready",
                "reasons": [],
                "engines": {"e0": True, "e1": True},
            }
            registry = gw.deployment.registry
            assert isinstance(registry, LocalRegistry)
            assert registry._journal is not None
            registry._journal.close()  # the disk goes away under the registry
            with pytest.raises(JournalError):
                await registry.forget_sessions(request_id=new_request_id(), session_keys=["x"])
            assert registry.failed is not None
            not_ready = await http.get("/health/ready")
            assert not_ready.status_code == 503
            body = not_ready.json()
            assert (body["status"], body["reasons"]) == ("not_ready", ["registry_failed"])
            assert "registry_error" in body
            # Liveness is the process answering, whatever the registry did.
            for route in ("/health/live", "/health"):
                live = await http.get(route)
                assert (live.status_code, live.json()) == (200, {"status": "ok"})
            # A restart cannot be recorded now: the engine is not routed to, nothing is loaded.
            fleet["e1"].restart()
            report = await gw.deployment.repairer.repair_once()
            assert (report.restarted, report.results) == ((), ())
            await registry.aclose()
            closed = gw.deployment.repairer.readiness()
            assert closed.reasons == ("registry_failed", "registry_closed")


async def test_readiness_is_false_while_no_engine_answers(tmp_path: Path) -> None:
    with ScriptedFleet() as fleet:
        async with gateway(fleet, tmp_path) as (gw, http):
            repairer = gw.deployment.repairer
            for engine in fleet.engines.values():
                engine.script(EngineOp.SERVER_INFO, Fault(FaultKind.UNREACHABLE))
            repairer.poke()
            await repairer.settled()
            down = await http.get("/health/ready")
            assert down.status_code == 503
            assert down.json() == {
                "status": "not_ready",
                "reasons": ["no_engine_ready"],
                "engines": {"e0": False, "e1": False},
            }
            repairer.poke()  # the engines answer again
            await repairer.settled()
            assert (await http.get("/health/ready")).status_code == 200


async def test_readiness_needs_a_first_probe_and_a_registry_that_answered_recently(
    tmp_path: Path,
) -> None:
    """A Ray registry's actor that stops answering: readiness goes false once its last good
    status read is older than three probe intervals (an injected clock, no waiting)."""
    now = [0.0]
    actor = RegistryActor({"engines": ["e0", "e1"], "capacity": 2})
    handle = _Handle(actor)
    client = RayRegistryClient(handle)
    with ScriptedFleet() as fleet:
        backend = HttpPushBackend(tmp_path / "store")
        repairer = Repairer(
            client,
            backend,
            fleet.refs,
            snapshots=SnapshotCache(),
            probe_interval=2.0,
            monotonic=lambda: now[0],
        )
        try:
            before = repairer.readiness()
            assert not before.ready
            assert before.reasons == ("registry_unanswered", "not_probed")
            await repairer.repair_once()
            assert repairer.readiness().ready
            handle.read_fails = True
            now[0] = 5.0
            await repairer.repair_once()
            assert repairer.readiness().ready  # 5 s since the last good read: within 3 x 2 s
            now[0] = 6.5
            stale = repairer.readiness()
            assert (stale.ready, stale.reasons) == (False, ("registry_unanswered",))
            assert stale.registry_error == "ConnectionError"
            handle.read_fails = False
            await repairer.repair_once()
            assert repairer.readiness().ready
        finally:
            await backend.aclose()
            await actor.flush()


# --- the Ray client learns a restart -------------------------------------------------------------


class _Method:
    """A Ray actor method handle: ``.remote(...)`` returns an awaitable."""

    def __init__(self, fn: Callable[..., Awaitable[Any]], handle: _Handle, read: bool) -> None:
        self._fn, self._handle, self._read = fn, handle, read

    def remote(self, *args: Any) -> Awaitable[Any]:
        async def run() -> Any:
            if self._read:
                self._handle.reads.set()
                if self._handle.read_fails:
                    raise ConnectionError("the actor did not answer")
            return await self._fn(*args)

        return run()


class _Handle:
    """Stands in for the Ray actor handle around an in-process RegistryActor (the outer edge)."""

    def __init__(self, actor: RegistryActor) -> None:
        self.read_fails = False
        self.reads = asyncio.Event()
        self.call = _Method(actor.call, self, False)
        self.call_batch = _Method(actor.call_batch, self, False)
        self.read = _Method(actor.read, self, True)
        self.start = _Method(actor.start, self, False)


async def test_the_ray_client_cache_learns_a_restart_from_a_refused_dispatch_and_a_refresh() -> (
    None
):
    actor = RegistryActor({"engines": ["e0", "e1"], "capacity": 2})
    client = RayRegistryClient(_Handle(actor))
    other = RayRegistryClient(_Handle(actor))  # another process: a repairer's registry client
    try:
        r = await publish_by_verbs(
            client, "A", ("e0", "e1"), digest=A.digest, incarnation=lambda e: f"{e}-1"
        )
        binding = await client.bind_first(request_id=new_request_id(), session_key="s")
        assert client.peek_version("A").ready_engines == ("e0", "e1")  # type: ignore[union-attr]

        await other.observe_incarnation(request_id=new_request_id(), engine="e1", incarnation="2")
        assert client.peek_version("A").ready_engines == ("e0", "e1")  # type: ignore[union-attr]
        first = client.on_refused("e1", binding)
        assert client.on_refused("e1", binding) is first  # one re-read per version at a time
        await first
        assert client.peek_version("A").ready_engines == ("e0",)  # type: ignore[union-attr]

        await other.record_ready(
            request_id=new_request_id(),
            receipt=ReadyReceipt("e1", r.ref, "2"),
        )
        handle: _Handle = client.actor
        handle.reads.clear()
        client.start_refresh(0.001)
        client.start_refresh(0.001)  # idempotent
        await handle.reads.wait()
        await client.stop_refresh()
        assert client.peek_version("A").ready_engines == ("e0", "e1")  # type: ignore[union-attr]
        with pytest.raises(ValueError, match="above 0"):
            client.start_refresh(0)
        # A failed re-read or refresh keeps the last answer and says so; nothing raises.
        handle.read_fails = True
        await client.on_refused("e0", binding)
        handle.reads.clear()
        client.start_refresh(0.001)
        await handle.reads.wait()
        await client.stop_refresh()
        assert client.peek_version("A").ready_engines == ("e0", "e1")  # type: ignore[union-attr]
    finally:
        await actor.flush()


async def test_a_deployment_wires_a_ray_client_refresh_to_refusals_and_its_lifecycle(
    tmp_path: Path,
) -> None:
    actor = RegistryActor({"engines": ["e0", "e1"], "capacity": 2})
    client = RayRegistryClient(_Handle(actor))
    with ScriptedFleet() as fleet:
        d = Deployment.from_settings(
            _settings(fleet),
            registry=client,
            backend_options={"store_root": str(tmp_path / "store")},
        )
        listeners: list[Any] = list(d.versioning.on_refused)
        assert client.on_refused in listeners
        async with d:
            refreshing = client._refresher
            assert refreshing is not None  # started with the Deployment
            await d.repairer.settled()
        assert refreshing.done()  # and stopped with it
        assert client._refresher is None
    await actor.flush()


# --- pieces ----------------------------------------------------------------------------------------


async def test_version_locks_serialize_per_version_and_forget_idle_ones() -> None:
    locks = VersionLocks()
    order: list[str] = []
    inside = asyncio.Event()
    leave = asyncio.Event()

    async def holder(version_id: str, tag: str, wait: bool) -> None:
        async with locks.hold(version_id):
            order.append(f"{tag} in")
            if wait:
                inside.set()
                await leave.wait()
            order.append(f"{tag} out")

    first = asyncio.create_task(holder("A", "a1", True))
    await inside.wait()
    second = asyncio.create_task(holder("A", "a2", False))
    other = asyncio.create_task(holder("B", "b", False))
    await other  # another version is never held up
    await asyncio.sleep(0)
    assert (locks.locked("A"), locks.contenders("A")) == (True, 2)
    leave.set()
    await asyncio.gather(first, second)
    assert order == ["a1 in", "b in", "b out", "a1 out", "a2 in", "a2 out"]
    assert (locks.locked("A"), locks.contenders("A"), locks.contenders("B")) == (False, 0, 0)


async def test_repairable_means_published_or_retired_with_sessions() -> None:
    def v(state: VersionState, refs: int = 0) -> VersionStatus:
        return VersionStatus("A", A.digest, "lora-A", state, 1, refs)

    assert repairable(v(VersionState.PUBLISHED))
    assert repairable(v(VersionState.RETIRED, 1))
    assert not repairable(v(VersionState.RETIRED, 0))
    for state in (VersionState.LOADING, VersionState.RECLAIMING, VersionState.ABORTED):
        assert not repairable(v(state, 1))


async def test_a_repairer_checks_its_settings_and_its_fleet(tmp_path: Path) -> None:
    registry = LocalRegistry(engines=("e0", "e1"), capacity=2, sweep_interval=None)
    backend = HttpPushBackend(tmp_path / "store")
    refs = [EngineRef("e0", "http://127.0.0.1:31000")]
    try:
        bads: list[dict[str, Any]] = [{"probe_interval": 0}, {"probe_timeout": -1}]
        for bad in bads:
            with pytest.raises(ConfigurationError) as err:
                Repairer(registry, backend, refs, snapshots=SnapshotCache(), **bad)
            assert err.value.details["check"] in ("probe_interval", "probe_timeout")
        with ScriptedFleet() as fleet:
            repairer = Repairer(registry, backend, fleet.refs[:1], snapshots=SnapshotCache())
            with pytest.raises(ConfigurationError, match="not the registry's"):
                await repairer.repair_once()
            # In the background a misconfigured round is logged, never raised.
            async with repairer:
                await repairer.settled()
            assert repairer.rounds == 1
    finally:
        await backend.aclose()
        await registry.aclose()


async def test_the_probe_interval_is_a_setting_and_a_flag() -> None:
    with ScriptedFleet() as fleet:
        assert _settings(fleet, probe_interval=2.0).probe_interval == 2.0
        assert load_settings(engines=["e0=http://127.0.0.1:1"]).probe_interval == 2.0
        for bad in (0, -1.0, float("inf")):
            with pytest.raises(ConfigurationError) as err:
                _settings(fleet, probe_interval=bad)
            assert err.value.details["check"] == "probe_interval"
        parser = add_arguments(argparse.ArgumentParser())
        args = parser.parse_args(["--versioned-lora-probe-interval", "0.5"])
        assert from_args(args, engines=["e0=http://127.0.0.1:1"]).probe_interval == 0.5


async def test_a_lost_ready_reply_is_never_cleaned_and_a_failed_prepare_is_retried(
    tmp_path: Path,
) -> None:
    with ScriptedFleet() as fleet:
        registry = LocalRegistry(engines=("e0", "e1"), capacity=2, sweep_interval=None)
        backend = HttpPushBackend(tmp_path / "store")
        cache = SnapshotCache()
        try:
            publisher = Publisher(registry, backend, fleet.refs)
            reclaimer = Reclaimer(registry, backend, fleet.refs)
            with cache.publishing("A", A):
                assert (await publisher.publish("A", A)).ok
            health = EngineHealth(["e0", "e1"])
            repairer = Repairer(
                _LosesReadyReplies(registry),
                backend,
                fleet.refs,
                snapshots=cache,
                version_locks=reclaimer.version_locks,
                health=health,
                registry_retry=RegistryRetry(attempts=2, wait=wait_none()),
            )
            name_a = (await registry.version("A")).lora_name
            fleet["e1"].restart()
            fleet["e1"].script(EngineOp.LOAD, Fault(FaultKind.REFUSE))
            failed = await repairer.repair_once()
            (result,) = failed.results
            assert (result.outcome, result.error_code) == (RepairOutcome.FAILED, "BACKEND_REFUSED")
            lost = await repairer.repair_once()
            (result,) = lost.results
            assert result.outcome is RepairOutcome.FAILED  # recorded, but the reply was lost
            assert result.cleaned is None
            assert fleet["e1"].holds(name_a)
            assert fleet["e1"].count(EngineOp.UNLOAD) == 0
            assert (await registry.version("A")).ready_engines == ("e0", "e1")
            assert (await repairer.repair_once()).results == ()
        finally:
            await backend.aclose()
            await registry.aclose()


class _LosesReadyReplies:
    """The real registry behind a connection that loses every record_ready reply (after the
    registry applied it): the outer edge of a remote registry."""

    def __init__(self, inner: LocalRegistry) -> None:
        self._inner = inner

    async def record_ready(self, **kwargs: Any) -> Any:
        await self._inner.record_ready(**kwargs)
        raise ConnectionError("reply lost")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


async def test_an_engine_that_comes_back_is_routed_to_only_once_the_registry_knows_it_restarted(
    tmp_path: Path,
) -> None:
    """Between reading the new incarnation and the registry recording it, the engine still
    counts as holding A: routing to it then would send A's requests to a process without A."""
    with ScriptedFleet() as fleet:
        registry = RecordingRegistry(LocalRegistry(engines=("e0", "e1"), capacity=2))
        backend = HttpPushBackend(tmp_path / "store")
        cache = SnapshotCache()
        try:
            with cache.publishing("A", A):
                assert (await Publisher(registry, backend, fleet.refs).publish("A", A)).ok
            health = EngineHealth(["e0", "e1"])
            repairer = Repairer(registry, backend, fleet.refs, snapshots=cache, health=health)
            fleet["e1"].script(EngineOp.SERVER_INFO, Fault(FaultKind.UNREACHABLE))
            await repairer.repair_once()  # e1 is down
            assert health.healthy() == ("e0",)
            assert repairer.readiness().engines == {"e0": True, "e1": False}
            fleet["e1"].restart()  # and back, as a new process without A
            gate = registry.gate("observe_incarnation")
            probing = asyncio.create_task(repairer.repair_once())
            await registry.entered["observe_incarnation"].wait()
            assert repairer.ready_engines == ("e0", "e1")  # it answers (readiness)...
            assert health.healthy() == ("e0",)  # ...but is not routed to yet
            gate.set()
            report = await probing
            assert report.restarted == ("e1",)
            assert report.repaired == (("A", "e1"),)
            assert health.healthy() == ("e0", "e1")
        finally:
            await backend.aclose()
            await registry.inner.aclose()
