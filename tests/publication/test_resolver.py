"""Blocked publications resolve themselves: the background resolver against scripted SGLang
engines (respx) and the real LocalRegistry, Publisher and HTTP push backend.

Every wait is stepped by the test: the resolver's sleep is injected (:class:`Naps` records each
backoff pause and holds it until the test ends it), rounds are awaited with ``settled(rounds=n)``,
and an engine call or a publication is held on an :class:`asyncio.Event`. Nothing depends on
which of two things finishes first by wall clock.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from agentic_lora_http import HttpPushBackend

from agentic_lora.assembly.deployment import Deployment
from agentic_lora.engines.backends import PublicationTarget
from agentic_lora.errors import PublicationBlockedError
from agentic_lora.publication.publisher import Phase
from agentic_lora.publication.publisher import PhaseStatus
from agentic_lora.publication.publisher import PublicationOutcome
from agentic_lora.publication.publisher import Publisher
from agentic_lora.publication.resolver import Resolver
from agentic_lora.publication.resolver import backoff
from agentic_lora.registry.local import LocalRegistry
from agentic_lora.registry.types import VersionState
from agentic_lora.registry.types import new_request_id
from agentic_lora.testing.fleet import ScriptedFleet
from agentic_lora.testing.sglang_engine import EngineOp
from agentic_lora.testing.sglang_engine import Fault
from agentic_lora.testing.sglang_engine import FaultKind
from tests.publication.support import FAST
from tests.publication.support import A
from tests.publication.support import B
from tests.publication.support import C
from tests.publication.support import LinkedWorld
from tests.publication.support import Progress
from tests.publication.support import ground
from tests.publication.support import publish
from tests.session_support import Calls

pytestmark = pytest.mark.asyncio


class Naps:
    """The resolver's injected sleep: records every pause and holds it until :meth:`end`."""

    def __init__(self) -> None:
        self.delays: list[float] = []
        self._gates: list[asyncio.Event] = []
        self._called = asyncio.Condition()

    async def __call__(self, delay: float) -> None:
        gate = asyncio.Event()
        async with self._called:
            self.delays.append(delay)
            self._gates.append(gate)
            self._called.notify_all()
        await gate.wait()

    async def reached(self, count: int) -> None:
        """Wait until the resolver has started its ``count``-th pause."""
        async with self._called:
            await self._called.wait_for(lambda: len(self.delays) >= count)

    def end(self) -> None:
        """End the latest pause: the resolver's next round starts."""
        self._gates[-1].set()


@dataclass
class World(LinkedWorld):
    resolver: Resolver
    naps: Naps

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """The resolver started and its start-up round (nothing to do yet) over; stopped after."""
        async with self.resolver:
            await self.resolver.settled(rounds=1)
            yield

    def phases(self, engine: str | None, phase: Phase, status: PhaseStatus) -> int:
        return sum(
            1
            for e in self.progress.events
            if (e.engine, e.phase, e.status) == (engine, phase, status)
        )


@pytest_asyncio.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    async with ground(tmp_path / "store") as g:
        publisher = Publisher(
            g.link,  # type: ignore[arg-type]
            g.backend,
            g.fleet.refs,
            on_progress=g.progress,
            registry_retry=FAST,
        )
        naps = Naps()
        resolver = Resolver(publisher, sleep=naps)
        yield World(g.fleet, g.registry, g.link, g.backend, publisher, g.progress, resolver, naps)
        await resolver.stop()


def pause(resolver: Resolver) -> float | None:
    """The resolver's pending pause, read fresh (a test's earlier asserts do not narrow it)."""
    return resolver.retry_in


async def block_v2(
    world: World, unload_faults: int, kind: FaultKind = FaultKind.SERVER_ERROR
) -> None:
    """v1 is the default; v2's load on e1 is lost and e1's next cleanups fail: v2 is BLOCKED."""
    assert await publish(world, "v1", A) is PublicationOutcome.PUBLISHED
    world.fleet["e1"].script(EngineOp.LOAD, Fault(FaultKind.LOSE_REPLY))
    world.fleet["e1"].script(EngineOp.UNLOAD, *(Fault(kind) for _ in range(unload_faults)))
    result = await world.publisher.publish("v2", B)
    assert result.outcome is PublicationOutcome.BLOCKED
    assert {r.engine: r.cleaned for r in result.engines} == {"e0": True, "e1": False}
    assert world.state("v2") is VersionState.ABORTED
    assert world.fleet["e1"].holds(world.name("v2"))  # the lost reply's load did happen


# --- retried with backoff until every engine confirmed ------------------------------------------


async def test_an_unanswered_cleanup_is_retried_with_backoff_until_the_slot_is_freed(
    world: World,
) -> None:
    world.resolver.start()
    await world.resolver.settled(rounds=1)  # the start-up round: nothing to do
    # The publication's own cleanup and the next two rounds' fail on e1.
    await block_v2(world, unload_faults=3)
    await world.resolver.settled(rounds=2)  # the BLOCKED result poked a round at once
    assert world.fleet["e1"].count(EngineOp.UNLOAD) == 2
    assert world.state("v2") is VersionState.ABORTED
    assert world.resolver.retry_in == 1.0
    await world.naps.reached(1)
    with pytest.raises(PublicationBlockedError):
        await world.publisher.publish("v3", C)

    world.naps.end()
    await world.resolver.settled(rounds=3)
    assert world.fleet["e1"].count(EngineOp.UNLOAD) == 3
    assert world.resolver.retry_in == 2.0
    await world.naps.reached(2)
    assert world.naps.delays == [1.0, 2.0]
    assert world.state("v2") is VersionState.ABORTED
    assert await world.slots() == 2  # unknown is never treated as released

    world.naps.end()  # e1 answers now
    await world.resolver.settled(rounds=4)
    assert world.state("v2") is VersionState.FAILED_CLEAN
    assert (pause(world.resolver), world.resolver.failures) == (None, 0)
    assert not world.fleet["e1"].holds(world.name("v2"))
    assert world.fleet["e1"].physical_unloads[world.name("v2")] == 1
    # e0 confirmed during the publication and is never asked again.
    assert world.fleet["e0"].count(EngineOp.UNLOAD) == 1
    assert await world.slots() == 1
    assert world.publisher.abandoned == set()
    # Each round's progress names the version it worked on.
    cleanups = [e for e in world.progress.events if (e.engine, e.phase) == ("e1", Phase.CLEANUP)]
    assert {e.version_id for e in cleanups} == {"v2"}
    assert [e.status for e in cleanups if e.status is not PhaseStatus.STARTED] == [
        PhaseStatus.FAILED,
        PhaseStatus.FAILED,
        PhaseStatus.FAILED,
        PhaseStatus.DONE,
    ]
    assert await publish(world, "v3", C) is PublicationOutcome.PUBLISHED


async def test_the_backoff_doubles_up_to_its_cap_and_a_poke_cuts_a_pause_short(
    world: World,
) -> None:
    resolver = Resolver(world.publisher, wait=backoff(0.5, 1.0), sleep=world.naps)
    assert world.publisher.resolver is resolver
    async with resolver:
        await resolver.settled(rounds=1)
        await block_v2(world, unload_faults=5, kind=FaultKind.UNREACHABLE)
        await resolver.settled(rounds=2)
        for n in (1, 2, 3):
            await world.naps.reached(n)
            world.naps.end()
            await resolver.settled(rounds=2 + n)
        await world.naps.reached(4)
        assert world.naps.delays == [0.5, 1.0, 1.0, 1.0]
        assert resolver.failures == 4
        # The engine is back: an operator's poke retries now, without waiting out the pause.
        world.fleet["e1"].clear_script()
        resolver.poke()
        await resolver.settled(rounds=6)
        assert world.state("v2") is VersionState.FAILED_CLEAN
        assert resolver.retry_in is None
        assert world.naps.delays == [0.5, 1.0, 1.0, 1.0]


async def test_a_round_that_cannot_read_the_registry_is_retried_after_a_pause(
    world: World,
) -> None:
    async with world.running():
        await block_v2(world, unload_faults=1)  # only the publication's own cleanup fails
        # Set before the poked round reads the registry (nothing awaited in between): lost.
        world.link.drop["status"] = 1
        await world.resolver.settled(rounds=2)
        assert world.state("v2") is VersionState.ABORTED
        assert (world.resolver.failures, world.resolver.retry_in) == (1, 1.0)
        await world.naps.reached(1)
        world.naps.end()
        await world.resolver.settled(rounds=3)
        assert world.state("v2") is VersionState.FAILED_CLEAN
        assert (world.resolver.failures, pause(world.resolver)) == (0, None)


# --- a restart is proof of cleanup --------------------------------------------------------------


async def test_an_engine_that_restarts_while_blocked_frees_the_slot_without_a_cleanup_call(
    world: World,
) -> None:
    async with world.running():
        await block_v2(world, unload_faults=5)
        await world.resolver.settled(rounds=2)
        await world.naps.reached(1)
        world.fleet["e1"].restart()  # the new process holds nothing, v2 included
        unloads = world.fleet["e1"].count(EngineOp.UNLOAD)
        cleanups = world.phases("e1", Phase.CLEANUP, PhaseStatus.STARTED)

        world.naps.end()
        await world.resolver.settled(rounds=3)
        assert world.state("v2") is VersionState.FAILED_CLEAN
        assert world.fleet["e1"].count(EngineOp.UNLOAD) == unloads
        assert world.phases("e1", Phase.CLEANUP, PhaseStatus.STARTED) == cleanups
        assert world.registry.peek_version("v2").cleaned_engines == ("e0", "e1")  # type: ignore[union-attr]
        assert world.resolver.retry_in is None
        assert await world.slots() == 1
        # The restarted engine takes the next version like any other.
        assert await publish(world, "v3", C) is PublicationOutcome.PUBLISHED
        assert world.fleet["e1"].holds(world.name("v3"))


# --- publications nobody is finishing -----------------------------------------------------------


def deployment_settings(fleet: ScriptedFleet, journal: Path, **extra: Any) -> Any:
    return fleet.settings(journal_path=journal, **extra)


async def test_a_version_a_dead_publisher_left_loading_is_aborted_and_cleaned_at_start(
    tmp_path: Path,
) -> None:
    journal, store = tmp_path / "registry.sqlite", tmp_path / "store"
    with ScriptedFleet(("e0", "e1")) as fleet:
        # The process that dies: v1 published, v2 reserved and READY on e0 only.
        registry = LocalRegistry(engines=("e0", "e1"), capacity=2, journal_path=journal)
        backend = HttpPushBackend(store)
        publisher = Publisher(registry, backend, fleet.refs, registry_retry=FAST)
        assert (await publisher.publish("v1", A)).outcome is PublicationOutcome.PUBLISHED
        reservation = await registry.reserve(
            request_id=new_request_id(), version_id="v2", digest=B.digest
        )
        target = PublicationTarget("v2", B.digest, reservation.lora_name, reservation.attempt)
        receipt = await backend.prepare(fleet.refs[0], target, B)
        await registry.record_ready(request_id=new_request_id(), receipt=receipt)
        await backend.aclose()
        await registry.aclose()
        assert fleet["e0"].holds(reservation.lora_name)

        progress = Progress()
        async with Deployment.from_settings(
            deployment_settings(fleet, journal),
            backend_options={"store_root": str(store)},
            on_progress=progress,
        ) as d:
            await d.resolver.settled(rounds=1)
            status = await d.status()
            v2 = next(v for v in status.versions if v.version_id == "v2")
            assert v2.state is VersionState.FAILED_CLEAN
            assert (status.default_version, status.slots_in_use) == ("v1", 1)
            assert not fleet["e0"].holds(reservation.lora_name)
            assert fleet["e0"].physical_unloads[reservation.lora_name] == 1
            aborts = [e for e in progress.events if e.phase is Phase.ABORT]
            assert {(e.version_id, e.status) for e in aborts} == {
                ("v2", PhaseStatus.STARTED),
                ("v2", PhaseStatus.DONE),
            }
            # The same version can be published again: a new attempt on the freed slot.
            again = await d.publish("v2", B)
            assert (again.outcome, again.attempt) == (PublicationOutcome.PUBLISHED, 2)


async def test_a_background_round_leaves_alone_a_loading_version_it_does_not_know_abandoned(
    world: World,
) -> None:
    async with world.running():
        assert await publish(world, "v1", A) is PublicationOutcome.PUBLISHED
        # Reserved behind this publisher's back (as another publishing process would).
        await world.registry.reserve(request_id=new_request_id(), version_id="v2", digest=B.digest)
        world.resolver.poke()
        await world.resolver.settled(rounds=2)
        assert world.state("v2") is VersionState.LOADING
        assert world.fleet.calls(EngineOp.UNLOAD) == 0
        # The operator says otherwise: resolving everything takes LOADING versions too.
        report = await world.resolver.resolve()
        assert (report.resolved, report.blocked) == (("v2",), ())
        assert report.results[0].outcome is PublicationOutcome.FAILED_CLEAN
        assert world.state("v2") is VersionState.FAILED_CLEAN


async def test_a_cancelled_publication_is_aborted_and_cleaned_in_the_background(
    world: World,
) -> None:
    async with world.running():
        assert await publish(world, "v1", A) is PublicationOutcome.PUBLISHED
        gate, reached = asyncio.Event(), asyncio.Event()
        world.fleet["e1"].script(EngineOp.LOAD, Fault.waiting_for(gate, reached))
        publication = asyncio.create_task(world.publisher.publish("v2", B))
        await reached.wait()
        publication.cancel()
        with pytest.raises(asyncio.CancelledError):
            await publication
        assert world.publisher.abandoned == {"v2"}
        await world.resolver.settled(rounds=2)
        assert world.state("v2") is VersionState.FAILED_CLEAN
        assert world.publisher.abandoned == set()
        assert not world.fleet["e0"].holds(world.name("v2"))
        assert await world.slots() == 1


async def test_a_blocked_commit_that_did_happen_is_left_published(world: World) -> None:
    async with world.running():
        assert await publish(world, "v1", A) is PublicationOutcome.PUBLISHED
        world.link.drop["commit"] = FAST.attempts
        result = await world.publisher.publish("v2", B)
        assert result.outcome is PublicationOutcome.BLOCKED
        await world.resolver.settled(rounds=2)
        # The registry says the commit happened: nothing is aborted, nothing unloaded.
        assert world.state("v2") is VersionState.PUBLISHED
        assert world.fleet.calls(EngineOp.UNLOAD) == 0
        assert world.publisher.abandoned == set()
        assert world.resolver.retry_in is None


# --- never while this process publishes ---------------------------------------------------------


@pytest.fixture
def resolver_waits(world: World) -> Calls:
    """Called when a resolve queues behind the publisher's lock (:attr:`Resolver.on_queued`)."""
    queued = Calls()
    world.resolver.on_queued.append(queued)
    return queued


async def test_the_resolver_waits_for_a_publication_in_progress_and_never_aborts_it(
    world: World, resolver_waits: Calls
) -> None:
    assert await publish(world, "v1", A) is PublicationOutcome.PUBLISHED
    gate, reached = asyncio.Event(), asyncio.Event()
    world.fleet["e0"].script(EngineOp.LOAD, Fault.waiting_for(gate, reached))
    publication = asyncio.create_task(world.publisher.publish("v2", B))
    await reached.wait()

    # A start-up round takes every LOADING version; v2 is one, but it is being published.
    world.resolver.start()
    await resolver_waits.wait()  # told right before it queued on the publisher's lock
    assert resolver_waits.calls == [("v2",)]
    assert world.state("v2") is VersionState.LOADING
    assert world.phases(None, Phase.ABORT, PhaseStatus.STARTED) == 0
    assert world.resolver.rounds == 0

    gate.set()
    assert (await publication).outcome is PublicationOutcome.PUBLISHED
    await world.resolver.settled(rounds=1)
    assert world.state("v2") is VersionState.PUBLISHED
    assert world.phases(None, Phase.ABORT, PhaseStatus.STARTED) == 0
    assert world.fleet.calls(EngineOp.UNLOAD) == 0
    assert world.fleet["e0"].holds(world.name("v2"))
    assert world.fleet["e1"].holds(world.name("v2"))


# --- through a Deployment -----------------------------------------------------------------------


async def test_a_deployment_paces_its_resolver_with_the_configured_backoff(tmp_path: Path) -> None:
    with ScriptedFleet(("e0", "e1")) as fleet:
        settings = deployment_settings(
            fleet,
            tmp_path / "registry.sqlite",
            resolve_backoff_initial=60.0,
            resolve_backoff_max=120.0,
        )
        async with Deployment.from_settings(
            settings, backend_options={"store_root": str(tmp_path / "store")}
        ) as d:
            assert (await d.publish("v1", A)).outcome is PublicationOutcome.PUBLISHED
            fleet["e1"].script(EngineOp.LOAD, Fault(FaultKind.LOSE_REPLY))
            fleet["e1"].script(EngineOp.UNLOAD, *(Fault(FaultKind.UNREACHABLE) for _ in range(2)))
            assert (await d.publish("v2", B)).outcome is PublicationOutcome.BLOCKED
            await d.resolver.settled(rounds=2)
            assert d.resolver.retry_in == 60.0
            assert (await d.status()).pending_version == "v2"
            # The operator does not wait a minute: the engine answers, resolve now.
            report = await d.resolve("v2")
            assert report.resolved == ("v2",)
            assert report.results[0].outcome is PublicationOutcome.FAILED_CLEAN
            assert [r.engine for r in report.results[0].engines] == ["e1"]
            assert (await d.status()).pending_version is None
