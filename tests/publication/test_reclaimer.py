"""Reclaim against scripted SGLang engines (respx) and the real LocalRegistry.

One named test per reclaim rule of the fault scenarios (rules 7.1-7 and 7.1-8), plus the
reclaimer's own rules (native refcount, joined concurrent reclaims, the poke-driven background
loop).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio
from agentic_lora_http import HttpPushBackend

from agentic_lora.errors import CapacityError
from agentic_lora.publication.publisher import PublicationOutcome
from agentic_lora.publication.publisher import Publisher
from agentic_lora.publication.reclaimer import Reclaimer
from agentic_lora.publication.reclaimer import ReclaimOutcome
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
from tests.publication.support import ground
from tests.publication.support import publish
from tests.publication_support import RegistryReads

pytestmark = pytest.mark.asyncio


class SteppedClock:
    """The reclaimer's clock, moved only by the test (backoff deadlines never pass by themselves)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class World(RegistryReads):
    fleet: ScriptedFleet
    registry: LocalRegistry
    backend: HttpPushBackend
    publisher: Publisher
    reclaimer: Reclaimer
    clock: SteppedClock

    async def bind(self, key: str) -> str:
        return (
            await self.registry.bind_first(request_id=new_request_id(), session_key=key)
        ).version_id

    def unloads(self, version_id: str) -> dict[str, int]:
        return {n: e.physical_unloads[self.name(version_id)] for n, e in self.fleet.engines.items()}


@pytest_asyncio.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    async with ground(tmp_path / "store") as g:
        clock = SteppedClock()
        reclaimer = Reclaimer(g.registry, g.backend, g.fleet.refs, registry_retry=FAST, clock=clock)
        publisher = Publisher(
            g.registry, g.backend, g.fleet.refs, reclaimer=reclaimer, registry_retry=FAST
        )
        yield World(g.fleet, g.registry, g.backend, publisher, reclaimer, clock)
        await reclaimer.stop()


async def a_retired_and_bound_b_published(world: World) -> None:
    assert await publish(world, "v1", A) is PublicationOutcome.PUBLISHED
    assert await world.bind("s_a") == "v1"
    assert await publish(world, "v2", B) is PublicationOutcome.PUBLISHED
    assert world.state("v1") is VersionState.RETIRED


# --- rule 7.1-8: capacity 2, repeated reclaim, late unload receipts ----------------------------


async def test_capacity_2_refuses_c_with_zero_engine_calls_until_a_is_reclaimed_once_on_both(
    world: World,
) -> None:
    await a_retired_and_bound_b_published(world)
    calls = world.fleet.calls()
    # The registry refuses C before any transfer...
    with pytest.raises(CapacityError):
        await world.registry.reserve(request_id=new_request_id(), version_id="v3", digest=C.digest)
    # ...and through the publisher it is a skip (the run goes on with B).
    skipped = await world.publisher.publish("v3", C)
    assert skipped.outcome is PublicationOutcome.SKIPPED
    assert skipped.reason == "CAPACITY_ERROR"
    assert world.fleet.calls() == calls
    assert world.unloads("v1") == {"e0": 0, "e1": 0}

    world.reclaimer.start()
    await world.close("s_a")  # the last Session bound to A
    world.reclaimer.poke()
    await world.reclaimer.settled()

    assert world.state("v1") is VersionState.RECLAIMED
    assert world.unloads("v1") == {"e0": 1, "e1": 1}
    assert await world.slots() == 1
    accepted = await world.publisher.publish("v3", C)
    assert accepted.outcome is PublicationOutcome.PUBLISHED
    # Repeated rounds never unload A again.
    await world.reclaimer.reclaim_once()
    world.reclaimer.poke()
    await world.reclaimer.settled()
    assert world.unloads("v1") == {"e0": 1, "e1": 1}


async def test_a_lost_unload_receipt_is_retried_without_a_second_unload_and_the_slot_waits_for_both(
    world: World,
) -> None:
    await a_retired_and_bound_b_published(world)
    await world.close("s_a")
    world.fleet["e0"].script(EngineOp.UNLOAD, Fault(FaultKind.LOSE_REPLY))

    first = await world.reclaimer.reclaim_once()
    (result,) = first.results
    assert result.outcome is ReclaimOutcome.PENDING
    assert result.confirmed == ("e1",)
    assert result.unconfirmed == ("e0",)
    assert world.state("v1") is VersionState.RECLAIMING
    assert await world.slots() == 2  # E0 unconfirmed: the slot stays held
    with pytest.raises(CapacityError):
        await world.registry.reserve(request_id=new_request_id(), version_id="v3", digest=C.digest)

    second = await world.reclaimer.reclaim_once()
    assert second.reclaimed == ("v1",)
    assert second.results[0].reclaim_id == result.reclaim_id
    assert world.unloads("v1") == {"e0": 1, "e1": 1}
    # E0 was asked twice (the retry found it absent); E1, already confirmed, only once.
    assert world.fleet["e0"].count(EngineOp.UNLOAD) == 2
    assert world.fleet["e1"].count(EngineOp.UNLOAD) == 1
    assert await world.slots() == 1


async def test_a_late_duplicate_confirmation_changes_nothing(world: World) -> None:
    await a_retired_and_bound_b_published(world)
    await world.close("s_a")
    (result,) = (await world.reclaimer.reclaim_once()).results
    assert result.outcome is ReclaimOutcome.RECLAIMED
    assert result.reclaim_id is not None
    late = await world.registry.confirm_reclaim(
        request_id=new_request_id(), version_id="v1", reclaim_id=result.reclaim_id, engine="e0"
    )
    assert late.state is VersionState.RECLAIMED
    assert await world.slots() == 1
    assert world.unloads("v1") == {"e0": 1, "e1": 1}


# --- Session refs say when reclaim may start; the engine's refcount when unload may happen ------


async def test_a_bound_version_is_not_claimed(world: World) -> None:
    await a_retired_and_bound_b_published(world)
    assert (await world.reclaimer.reclaim_once()).results == ()
    (result,) = [await world.reclaimer.reclaim_version("v1")]
    assert result.outcome is ReclaimOutcome.STILL_BOUND
    assert world.state("v1") is VersionState.RETIRED
    assert world.fleet.calls(EngineOp.UNLOAD) == 0


async def test_reclaim_waits_for_requests_already_in_the_engine(world: World) -> None:
    await a_retired_and_bound_b_published(world)
    request = world.fleet["e0"].acquire(world.name("v1"))  # a long A request on E0
    await world.close("s_a")
    reclaim = asyncio.create_task(world.reclaimer.reclaim_once())
    await world.fleet["e0"].unload_blocked.wait()
    assert world.state("v1") is VersionState.RECLAIMING  # no new dispatch of A
    assert world.unloads("v1")["e0"] == 0
    assert not reclaim.done()
    await world.fleet["e0"].release(request)
    assert (await reclaim).reclaimed == ("v1",)
    assert world.unloads("v1") == {"e0": 1, "e1": 1}


async def test_concurrent_reclaims_of_one_version_share_one_unload_per_engine(world: World) -> None:
    await a_retired_and_bound_b_published(world)
    await world.close("s_a")
    gate, reached = asyncio.Event(), asyncio.Event()
    world.fleet["e0"].script(EngineOp.UNLOAD, Fault.waiting_for(gate, reached))
    first = asyncio.create_task(world.reclaimer.reclaim_version("v1"))
    second = asyncio.create_task(world.reclaimer.reclaim_version("v1"))
    await reached.wait()  # E0's unload is in flight; the second request joined the first
    gate.set()
    one, two = await first, await second
    assert one is two
    assert one.outcome is ReclaimOutcome.RECLAIMED
    assert world.fleet["e0"].count(EngineOp.UNLOAD) == 1
    assert world.fleet["e1"].count(EngineOp.UNLOAD) == 1


async def test_the_background_loop_reclaims_after_a_commit_poke(world: World) -> None:
    async with world.reclaimer:
        await world.publisher.publish("v1", A)
        await world.publisher.publish("v2", B)  # commit pokes: v1 has no Session
        await world.reclaimer.settled()
        assert world.state("v1") is VersionState.RECLAIMED
        assert world.reclaimer.rounds >= 1
        assert world.unloads("v1") == {"e0": 1, "e1": 1}


async def test_a_failing_round_does_not_stop_the_loop(world: World) -> None:
    await a_retired_and_bound_b_published(world)
    await world.close("s_a")
    world.fleet["e0"].script(EngineOp.UNLOAD, Fault(FaultKind.UNREACHABLE))
    async with world.reclaimer:
        world.reclaimer.poke()
        await world.reclaimer.settled()
        assert world.state("v1") is VersionState.RECLAIMING
        world.clock.now += world.reclaimer.retry_in or 0.0
        world.reclaimer.poke()
        await world.reclaimer.settled()
        assert world.state("v1") is VersionState.RECLAIMED
    assert world.unloads("v1") == {"e0": 1, "e1": 1}


async def test_pokes_during_a_versions_backoff_send_it_no_unload(world: World) -> None:
    # Under agent load every Session release pokes the reclaimer. An engine that is down must
    # cost one unload per backoff step, not one per release.
    await a_retired_and_bound_b_published(world)
    await world.close("s_a")
    e0 = world.fleet["e0"]
    e0.script(EngineOp.UNLOAD, *[Fault(FaultKind.SERVER_ERROR)] * 3)  # reached, not done
    async with world.reclaimer:
        world.reclaimer.poke()
        await world.reclaimer.settled()
        assert world.state("v1") is VersionState.RECLAIMING
        assert world.reclaimer.retry_in == 1.0
        tried = e0.count(EngineOp.UNLOAD)
        for _ in range(5):
            world.reclaimer.poke()
            await world.reclaimer.settled()
        assert e0.count(EngineOp.UNLOAD) == tried
        world.clock.now += 1.0
        world.reclaimer.poke()
        await world.reclaimer.settled()
        assert e0.count(EngineOp.UNLOAD) == tried + 1
        assert world.reclaimer.retry_in == 2.0  # the second unconfirmed round in a row doubles it
        world.clock.now += 2.0
        world.reclaimer.poke()
        await world.reclaimer.settled()
        assert world.state("v1") is VersionState.RECLAIMING  # the third scripted refusal
        world.clock.now += 4.0
        world.reclaimer.poke()
        await world.reclaimer.settled()
        assert world.state("v1") is VersionState.RECLAIMED
        assert world.reclaimer.retry_in is None


async def test_reclaim_results_carry_per_engine_timings(world: World) -> None:
    await a_retired_and_bound_b_published(world)
    await world.close("s_a")
    (result,) = (await world.reclaimer.reclaim_once()).results
    phases = {(t.engine, t.phase.value) for t in result.timings}
    assert {
        ("e0", "reclaim"),
        ("e1", "reclaim"),
        ("e0", "confirm_reclaim"),
        (None, "claim_reclaim"),
    } <= phases


async def test_a_claim_whose_replies_are_lost_is_replayed_by_the_next_round(world: World) -> None:
    await a_retired_and_bound_b_published(world)
    await world.close("s_a")
    real_claim = world.registry.claim_reclaim
    lost = {"left": FAST.attempts}

    async def claim_with_lost_replies(**kwargs: object) -> object:
        claim = await real_claim(**kwargs)  # type: ignore[arg-type]
        if lost["left"] > 0:
            lost["left"] -= 1
            raise ConnectionError("claim reply lost")
        return claim

    world.registry.claim_reclaim = claim_with_lost_replies  # type: ignore[method-assign]
    (first,) = (await world.reclaimer.reclaim_once()).results
    assert first.outcome is ReclaimOutcome.PENDING
    assert first.errors == (("registry", "ConnectionError"),)
    assert world.state("v1") is VersionState.RECLAIMING  # the claim did happen
    assert world.fleet.calls(EngineOp.UNLOAD) == 0
    assert (await world.reclaimer.reclaim_once()).reclaimed == ("v1",)
    assert world.unloads("v1") == {"e0": 1, "e1": 1}
