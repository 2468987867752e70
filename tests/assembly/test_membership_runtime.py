"""Engines joining and draining at runtime through :class:`Deployment`, against scripted SGLang
engines (respx at the HTTP edge) with the real LocalRegistry, backend, publisher, repairer and
Sessions.

Every concurrency point is an :class:`asyncio.Event` gate on a scripted engine call (a
generation or a load held until the test releases it) or a registry change the test waits for:
nothing here depends on how fast anything ran.
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
from agentic_lora.engines.transport import EngineReply
from agentic_lora.errors import DrainRefusedError
from agentic_lora.publication.result import PublicationOutcome
from agentic_lora.registry.api import change_feed
from agentic_lora.registry.types import MemberState
from agentic_lora.session import Session
from agentic_lora.testing.adapters import tiny_snapshot
from agentic_lora.testing.fleet import ScriptedFleet
from agentic_lora.testing.sglang_engine import EngineOp
from agentic_lora.testing.sglang_engine import Fault

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]

A, B, C = tiny_snapshot(1), tiny_snapshot(2), tiny_snapshot(3)
NO_TICK = 3600.0
M = MemberState


@contextlib.asynccontextmanager
async def deployment(
    fleet: ScriptedFleet, root: Path, gates: list[asyncio.Event], **settings: Any
) -> AsyncIterator[Deployment]:
    config = fleet.settings(probe_interval=NO_TICK, **settings)
    for engine in fleet.engines.values():
        engine.max_loras_per_batch = config.capacity + 1  # as the settings ask of the engines
    d = Deployment.from_settings(
        config,
        backend_options={"store_root": str(root / "store")},
    )
    async with d:
        try:
            await d.repairer.settled()
            yield d
        finally:
            for gate in gates:
                gate.set()  # a failed assertion must not leave a held call holding the shutdown


def applied(d: Deployment, verb: str) -> asyncio.Event:
    """Set once the registry applied ``verb``."""
    event = asyncio.Event()

    def listener(name: str, _result: Any) -> None:
        if name == verb:
            event.set()

    feed = change_feed(d.registry)
    assert feed is not None
    feed.add_listener(listener)
    return event


def hold(
    fleet: ScriptedFleet, engine: str, op: EngineOp, gates: list[asyncio.Event]
) -> tuple[asyncio.Event, asyncio.Event]:
    """The engine's next ``op`` call waits for the returned gate; the second event is set when
    it arrived."""
    gate, reached = asyncio.Event(), asyncio.Event()
    fleet[engine].script(op, Fault.waiting_for(gate, reached))
    gates.append(gate)
    return gate, reached


async def members(d: Deployment) -> dict[str, MemberState]:
    return {e.engine: e.membership for e in await d.engines()}


def adapter(reply: EngineReply) -> str:
    return str(reply.body["meta_info"]["lora_path"])


@contextlib.contextmanager
def only(d: Deployment, engine: str) -> Iterator[None]:
    """Within the block, every other engine is unhealthy: new requests are routed to ``engine``."""
    others = [e.name for e in d.versioning.engines if e.name != engine]
    for other in others:
        d.versioning.health.mark_unhealthy(other)
    try:
        yield
    finally:
        for other in others:
            d.versioning.health.mark_healthy(other)


async def held_turn(
    d: Deployment, s: Session, engine: str, reached: asyncio.Event
) -> asyncio.Task[EngineReply]:
    """A turn of ``s`` on ``engine``, started and left waiting there (its call arrived)."""
    with only(d, engine):
        task = asyncio.create_task(s.generate({"text": "held turn"}))
        await reached.wait()
    return task


async def test_a_drain_waits_for_the_engines_in_flight_request_then_removes_it(
    tmp_path: Path,
) -> None:
    gates: list[asyncio.Event] = []
    with ScriptedFleet() as fleet:
        async with deployment(fleet, tmp_path, gates) as d:
            assert (await d.publish("A", A)).ok
            name_a = (await d.registry.version("A")).lora_name
            s = d.versioning.open_session("agent")
            gate, reached = hold(fleet, "e1", EngineOp.GENERATE, gates)
            turn = await held_turn(d, s, "e1", reached)
            assert d.versioning.engine_in_flight("e1") == 1
            drained = applied(d, "drain_engine")
            draining = asyncio.create_task(d.drain_engine("e1"))
            await drained.wait()
            # DRAINING: nothing new reaches e1 while its request runs; Sessions go on on e0.
            assert await members(d) == {"e0": M.ACTIVE, "e1": M.DRAINING}
            other = d.versioning.open_session("other")
            replies = [await other.generate({"text": f"other {i}"}) for i in range(3)]
            assert {r.engine for r in replies} == {"e0"}
            assert not draining.done()
            gate.set()
            first = await turn
            assert (first.engine, adapter(first)) == ("e1", name_a)  # it ran to its end
            result = await draining
            assert result.outcome is DrainOutcome.REMOVED
            assert result.membership is M.REMOVED
            assert (result.in_flight_at_drain, result.in_flight) == (1, 0)
            assert await members(d) == {"e0": M.ACTIVE}
            # The Session goes on with its version, on the member that holds it.
            nxt = await s.generate({"text": "turn 2"})
            assert (nxt.engine, adapter(nxt)) == ("e0", name_a)
            # A removed engine holds no slot of any version.
            status = await d.registry.status()
            assert all("e1" not in v.held_engines for v in status.versions)
            assert [e.engine for e in status.engines] == ["e0"]


async def test_a_drain_that_reaches_its_bound_leaves_the_engine_draining_and_says_so(
    tmp_path: Path,
) -> None:
    gates: list[asyncio.Event] = []
    with ScriptedFleet() as fleet:
        async with deployment(fleet, tmp_path, gates) as d:
            assert (await d.publish("A", A)).ok
            s = d.versioning.open_session("agent")
            gate, reached = hold(fleet, "e1", EngineOp.GENERATE, gates)
            turn = await held_turn(d, s, "e1", reached)
            result = await d.drain_engine("e1", wait_bound=0)
            assert result.outcome is DrainOutcome.TIMED_OUT
            assert result.membership is M.DRAINING
            assert (result.in_flight_at_drain, result.in_flight) == (1, 1)
            assert await members(d) == {"e0": M.ACTIVE, "e1": M.DRAINING}
            gate.set()
            assert (await turn).engine == "e1"
            # Drained again, it only waits again (nothing is in flight now): removed.
            again = await d.drain_engine("e1")
            assert (again.outcome, again.in_flight_at_drain) == (DrainOutcome.REMOVED, 0)
            assert await members(d) == {"e0": M.ACTIVE}
            # The last ACTIVE member cannot be drained: the fleet would have nowhere to route.
            with pytest.raises(DrainRefusedError):
                await d.drain_engine("e0")


async def test_an_engine_added_under_load_gets_every_dispatchable_version_before_it_serves(
    tmp_path: Path,
) -> None:
    gates: list[asyncio.Event] = []
    with ScriptedFleet(("e0", "e1", "e2")) as fleet:
        async with deployment(fleet, tmp_path, gates, capacity=4) as d:
            # The fleet starts with two members: e2 is configured but not one of them.
            assert (await d.drain_engine("e2")).outcome is DrainOutcome.REMOVED
            assert (await d.publish("A", A)).ok
            old = d.versioning.open_session("old")
            await old.generate({"text": "old 1"})  # bound to A
            assert (await d.publish("B", B)).ok  # A is RETIRED and held
            names = {v: (await d.registry.version(v)).lora_name for v in "AB"}
            # e2's first load is held: publications meanwhile never wait for the joining engine.
            gate, reached = hold(fleet, "e2", EngineOp.LOAD, gates)
            adding = asyncio.create_task(d.add_engine("e2"))
            await reached.wait()
            assert (await members(d))["e2"] is M.JOINING
            published = await d.publish("C", C)
            assert published.outcome is PublicationOutcome.PUBLISHED
            assert {r.engine for r in published.engines} == {"e0", "e1"}
            names["C"] = (await d.registry.version("C")).lora_name
            assert not fleet["e2"].holds(names["C"])
            assert not adding.done()
            gate.set()
            assert await adding is M.ACTIVE
            # It holds the default (committed while it loaded) and the bound version A.
            assert fleet["e2"].holds(names["C"])
            assert fleet["e2"].holds(names["A"])
            assert (await d.registry.version("C")).ready_engines == ("e0", "e1", "e2")
            # Routable now: a new Session served there runs C, the old one A.
            new = d.versioning.open_session("new")
            with only(d, "e2"):
                new_reply = await new.generate({"text": "new 1"})
                old_reply = await old.generate({"text": "old 2"})
            assert (new_reply.engine, adapter(new_reply)) == ("e2", names["C"])
            assert (old_reply.engine, adapter(old_reply)) == ("e2", names["A"])


async def test_a_publication_reserved_before_a_drain_finishes_before_the_engine_is_removed(
    tmp_path: Path,
) -> None:
    gates: list[asyncio.Event] = []
    with ScriptedFleet() as fleet:
        async with deployment(fleet, tmp_path, gates, capacity=3) as d:
            assert (await d.publish("A", A)).ok
            gate, reached = hold(fleet, "e1", EngineOp.LOAD, gates)
            publishing = asyncio.create_task(d.publish("B", B))
            await reached.wait()  # B is reserved over e0 and e1; its load on e1 is held
            drained, removed = applied(d, "drain_engine"), applied(d, "remove_engine")
            draining = asyncio.create_task(d.drain_engine("e1"))
            await drained.wait()
            # Its removal waits for the publication, which holds the publisher.
            assert not removed.is_set()
            gate.set()
            result = await publishing
            assert result.outcome is PublicationOutcome.PUBLISHED
            assert (await draining).outcome is DrainOutcome.REMOVED
            assert (await d.registry.status()).default_version == "B"
            assert await members(d) == {"e0": M.ACTIVE}
