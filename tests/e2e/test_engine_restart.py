"""Issue 10, part 3, on real engines: an engine restarts under Sessions bound to A.

The measured bug: 8 Sessions bound to the published version A, one engine killed and restarted
(it comes back with no adapters); the 4 Sessions whose affinity pointed at it got
``REQUEST_REFUSED`` (the engine's HTTP 400) on all 12 of their later turns, and A was never loaded
onto it again.

Now: once the registry learns the new incarnation the restarted engine holds nothing, so those
Sessions' turns go to the other engine (every one succeeds: A is held there), the repairer loads
A onto the restarted engine again (pinned, probed, READY recorded), and the Sessions return to it.
The repair's READY is held at the backend (GatedBackend) through all 12 later turns, so the
"meanwhile" lasts as long as the test needs. On the wire (the recording proxies), nothing but
the backend's own probe names A on the restarted engine before A's load there answered, no
Session request reaches it before A's READY was recorded, and no generation gets an engine 400.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from agentic_lora.engines.transport import EngineReply
from agentic_lora.errors import VersionUnavailableError
from agentic_lora.publication.publisher import PublicationOutcome
from agentic_lora.registry.types import VersionStatus
from agentic_lora.session import Session
from tests.e2e.conftest import Stack
from tests.e2e.support import Held

pytestmark = [pytest.mark.engine, pytest.mark.slow]

SESSIONS_PER_ENGINE = 4
LATER_TURNS = 12


async def _turn(stack: Stack, session: Session, n: int) -> EngineReply | VersionUnavailableError:
    request = {
        "input_ids": stack.chat.first_turn(f"turn {n}: what is the weather in Paris?"),
        "sampling_params": {"max_new_tokens": 4, "temperature": 0.0},
    }
    try:
        return await session.generate(request)
    except VersionUnavailableError as exc:
        # Allowed only while no engine holds A (never, with one engine of two restarted).
        return exc


@pytest.mark.asyncio
async def test_sessions_keep_their_version_through_an_engine_restart_and_it_gets_a_back(
    stack: Stack,
) -> None:
    assert (await stack.publish("A")).outcome is PublicationOutcome.PUBLISHED
    version_a = stack.versions["A"]
    name_a = stack.lora_name("A")
    victim, survivor = stack.engine_names[1], stack.engine_names[0]
    homes: dict[str, list[Session]] = {}
    for engine in stack.engine_names:
        homes[engine] = [
            await stack.open_on(engine, f"restart-{engine}-{i}") for i in range(SESSIONS_PER_ENGINE)
        ]
    sessions = [s for group in homes.values() for s in group]
    first = await asyncio.gather(*(_turn(stack, s, 0) for s in sessions))
    assert [r.engine for r in first if isinstance(r, EngineReply)] == [
        e for e in stack.engine_names for _ in range(SESSIONS_PER_ENGINE)
    ]

    def incarnation(engine: str) -> str | None:
        known = {e.engine: e.incarnation for e in stack.registry.core.status().engines}
        return known[engine]

    before = incarnation(victim)
    # The repair's READY on the victim is held (the real backend has stored, loaded and probed A
    # by then), so "while A is being repaired" lasts through every later turn below.
    held_ready = stack.backend.ready_gates[victim] = asyncio.Event()
    restart = stack.traffic.mark(f"{victim} restarts")
    started = time.perf_counter()
    await stack.fleet.arestart(victim)  # stop, start on the same port: no adapters at all
    back_up = time.perf_counter()
    # The probe (every probe_interval) notices the new incarnation; poking it is the same probe,
    # now, so the test does not depend on the interval the stack was built with.
    stack.deployment.repairer.poke()
    await stack.watch.wait_for(
        "observe_incarnation",
        lambda _: incarnation(victim) != before,
        what=f"{victim}'s new incarnation in the registry",
    )
    observed = time.perf_counter()
    await stack.backend.held.wait_for(
        Held("prepare", victim, name_a).__eq__, what=f"A loaded and probed on {victim} again"
    )
    loaded = time.perf_counter()
    assert stack.status("A").ready_engines == (survivor,)  # not routed to before its READY

    failures: list[object] = []
    engines_of: dict[str, list[str]] = {s.key: [] for s in sessions}
    for n in range(1, LATER_TURNS + 1):
        replies = await asyncio.gather(*(_turn(stack, s, n) for s in sessions))
        for s, reply in zip(sessions, replies, strict=True):
            if isinstance(reply, EngineReply):
                engines_of[s.key].append(reply.engine)
            else:
                failures.append(reply)
    assert failures == []  # every later turn of every Session succeeded, on the engine holding A
    assert {e for s in sessions for e in engines_of[s.key]} == {survivor}

    released = stack.traffic.mark(f"A's READY on {victim} released")
    held_ready.set()
    # The registry's current view decides (the watch also holds the publication's READYs).
    await stack.watch.wait_for(
        "record_ready",
        lambda st: (
            isinstance(st, VersionStatus)
            and st.version_id == version_a
            and victim in stack.status("A").ready_engines
        ),
        what=f"A READY on {victim} again",
    )
    assert stack.status("A").ready_engines == tuple(stack.engine_names)
    back = await asyncio.gather(*(_turn(stack, s, LATER_TURNS + 1) for s in homes[victim]))
    assert {r.engine for r in back if isinstance(r, EngineReply)} == {victim}
    listed = await stack.raw.get(f"{stack.engine_url(victim)}/v1/models")
    assert name_a in {card["id"] for card in listed.json()["data"]}

    # On the wire, after the restart: A's load on the victim answered before any request for A
    # reached it (the backend's own one-token probe), no Session request reached it before A's
    # READY was recorded, and no generation anywhere was refused by an engine.
    after = stack.traffic.since(restart)
    (load,) = [e for e in after if e.engine == victim and e.path == "/load_lora_adapter"]
    assert (load.lora, load.status) == (name_a, 200)
    assert load.seq_done is not None
    for_a = [e for e in after if e.engine == victim and e.is_generation and e.lora == name_a]
    assert for_a
    assert all(e.seq_sent > load.seq_done for e in for_a)
    from_sessions = [e for e in for_a if e.field("rid") is not None]
    assert len(from_sessions) == SESSIONS_PER_ENGINE
    assert all(e.seq_sent > released for e in from_sessions)
    assert [e for e in after if e.is_generation and e.status != 200] == []

    print(
        f"\n{victim} restart: {back_up - started:.1f} s until it was up again (engine start "
        f"{stack.fleet.startup_seconds(victim) or 0.0:.1f} s); its new incarnation was in the "
        f"registry {observed - back_up:.2f} s and A loaded and probed on it "
        f"{loaded - back_up:.2f} s after that; {len(sessions) * LATER_TURNS} later turns, "
        f"0 failed, the {victim} Sessions' ones all served by {survivor}"
    )
