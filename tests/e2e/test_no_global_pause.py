"""Rule 7.3-2 on real engines: a publication under live traffic never pauses, flushes or aborts.

A-bound Sessions on both engines generate in a loop, and new Sessions keep joining (one
generation each), while B is published. The publication is held between E0's READY and E1's
READY until every loop has finished generations inside that window, so "the engines kept
serving during the publication" is shown, not assumed. Then:

* the recording proxies saw, between the start and the end of the publication, only the calls a
  publication needs (reads, the load, the probe) and the Sessions' own generations: no
  ``/pause_generation``, ``/flush_cache``, ``/continue_generation`` and no ``/abort_request`` at all;
* the engines' own access logs (everything that reached them, by any path) agree;
* not one generation failed, each one carried its Session's version, and joiners bound A before
  the commit and B after it.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from dataclasses import field

import pytest

from agentic_lora.publication.publisher import Phase
from agentic_lora.publication.publisher import PublicationOutcome
from agentic_lora.session import Session
from tests.e2e.conftest import Stack
from tests.e2e.recording_proxy import FORBIDDEN_DURING_PUBLICATION
from tests.e2e.recording_proxy import Waiters
from tests.e2e.support import fresh_id
from tests.e2e.support import scored_request

pytestmark = [pytest.mark.engine, pytest.mark.slow]

logger = logging.getLogger(__name__)

#: Generations every traffic loop must complete while the publication is held half-way.
IN_WINDOW = 2
#: Paths a publication itself may call (reads, load, probe generation).
PUBLICATION_PATHS = frozenset({"/server_info", "/v1/models", "/load_lora_adapter", "/generate"})


@dataclass
class Traffic:
    """The live load: who generated what, and a counter per loop to wait on."""

    stop: asyncio.Event = field(default_factory=asyncio.Event)
    done: Waiters[tuple[str, int]] = field(default_factory=Waiters)
    counts: dict[str, int] = field(default_factory=dict)
    sent: dict[str, str] = field(default_factory=dict)  # rid -> lora name the Session was bound to
    joiners: list[tuple[str, int]] = field(default_factory=list)  # (version, default revision)

    def count(self, loop: str) -> None:
        self.counts[loop] = self.counts.get(loop, 0) + 1
        self.done.publish((loop, self.counts[loop]))

    async def reached(self, loop: str, n: int) -> None:
        await self.done.wait_for(lambda d: d == (loop, n), what=f"{loop} made {n} generations")


async def _generate(stack: Stack, session: Session, engine: str, traffic: Traffic) -> None:
    rid = fresh_id("live")
    prompt = stack.chat.first_turn(f"live traffic on {engine}")
    reply = await session.generate(scored_request(prompt, max_new_tokens=6, rid=rid))
    assert reply.engine == engine
    assert reply.status_code == 200
    assert session.binding is not None
    traffic.sent[rid] = session.binding.lora_name


async def _bound_loop(stack: Stack, session: Session, engine: str, traffic: Traffic) -> None:
    while not traffic.stop.is_set():
        await _generate(stack, session, engine, traffic)
        traffic.count(f"bound-{engine}")


async def _joiners(stack: Stack, traffic: Traffic) -> None:
    turn = 0
    while not traffic.stop.is_set():
        engine = stack.engine_names[turn % 2]
        session = await stack.open_on(engine, "joiner")
        try:
            await _generate(stack, session, engine, traffic)
            assert session.binding is not None
            traffic.joiners.append((session.binding.version_id, session.binding.default_revision))
        finally:
            await session.close()
        traffic.count("joiners")
        turn += 1


@pytest.mark.asyncio
async def test_a_publication_under_live_traffic_never_pauses_flushes_or_aborts(
    stack: Stack,
) -> None:
    assert (await stack.publish("A")).outcome is PublicationOutcome.PUBLISHED
    a_revision = (await stack.registry.status()).default_revision
    traffic = Traffic()
    loops = []
    for engine in stack.engine_names:
        session = await stack.open_on(engine, f"bound-{engine}")
        loops.append(asyncio.create_task(_bound_loop(stack, session, engine, traffic)))
    loops.append(asyncio.create_task(_joiners(stack, traffic)))
    names = ["bound-E0", "bound-E1", "joiners"]
    for name in names:
        await traffic.reached(name, 1)

    logs_since = {name: log.offset() for name, log in stack.logs.items()}
    e1_ready = asyncio.Event()
    stack.backend.ready_gates["E1"] = e1_ready
    b = stack.version_id("B")
    started = stack.traffic.mark("publication of B starts")
    publishing = asyncio.create_task(stack.publish("B"))
    await stack.watch.wait_for(
        "record_ready", lambda s: s.version_id == b and "E0" in s.ready_engines, what="E0 READY"
    )
    await stack.backend.held.wait_for(lambda h: h.engine == "E1", what="E1 READY held")
    # The window: B half-published. Every loop must keep making progress in it.
    window = {name: traffic.counts[name] for name in names}
    for name in names:
        await traffic.reached(name, window[name] + IN_WINDOW)
    e1_ready.set()
    result = await publishing
    ended = stack.traffic.mark("publication of B ended")
    assert result.outcome is PublicationOutcome.PUBLISHED
    after = traffic.counts["joiners"]
    await traffic.reached("joiners", after + 2)  # joiners that can only have bound B
    traffic.stop.set()
    await asyncio.gather(*loops)  # any failed generation fails the test here

    during = [e for e in stack.traffic.since(started) if e.seq_sent < ended]
    assert {e.path for e in during} <= PUBLICATION_PATHS
    for name, log in stack.logs.items():
        answered = {path for _, path in log.requests(since=logs_since[name])}
        assert {"/generate", "/load_lora_adapter"} <= answered, name
        assert not answered & (FORBIDDEN_DURING_PUBLICATION | {"/abort_request"}), name
    assert stack.traffic.select(path="/abort_request") == []

    name_a, name_b = stack.lora_name("A"), stack.lora_name("B")
    for rid, bound_to in traffic.sent.items():
        (sent,) = stack.traffic.select(path="/generate", rid=rid)
        assert sent.lora == bound_to
        assert sent.status == 200
    assert {version for version, _ in traffic.joiners} == {stack.versions["A"], b}
    for version, revision in traffic.joiners:
        assert version == (stack.versions["A"] if revision == a_revision else b)
    bound = [e for e in stack.traffic.select(path="/generate") if e.field("rid") in traffic.sent]
    assert {e.lora for e in bound} == {name_a, name_b}
    measured = {
        "generations": len(traffic.sent),
        "in_window": {name: traffic.counts[name] - window[name] for name in names},
        "prepare_seconds": {e: result.seconds(Phase.PREPARE, e) for e in stack.engine_names},
        "commit_seconds": result.seconds(Phase.COMMIT),
    }
    logger.info("publication under live traffic: %s", measured, extra={"measured": measured})
