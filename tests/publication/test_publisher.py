"""Publication against scripted SGLang engines (respx) and the real LocalRegistry.

One named test per publication rule of the fault scenarios (rules 7.1-1 to 7.1-3), plus the
publisher's own rules (bootstrap, skip on capacity, blocked on unknown outcomes, progress and
timings).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from agentic_lora.adapters.snapshot import AdapterSnapshot
from agentic_lora.engines.backends import PublicationTarget
from agentic_lora.errors import BackendAmbiguousError
from agentic_lora.errors import BackendRefusedError
from agentic_lora.errors import PublicationBlockedError
from agentic_lora.errors import VersionConflictError
from agentic_lora.foundation.identity import make_lora_name
from agentic_lora.foundation.phases import PhaseRecorder
from agentic_lora.publication.publisher import Phase
from agentic_lora.publication.publisher import PhaseEvent
from agentic_lora.publication.publisher import PhaseStatus
from agentic_lora.publication.publisher import PublicationOutcome
from agentic_lora.publication.publisher import PublicationResult
from agentic_lora.publication.publisher import Publisher
from agentic_lora.publication.reclaimer import Reclaimer
from agentic_lora.publication.result import PublicationRun
from agentic_lora.registry.types import Binding
from agentic_lora.registry.types import VersionState
from agentic_lora.registry.types import new_request_id
from agentic_lora.testing.adapters import tiny_snapshot
from agentic_lora.testing.sglang_engine import EngineOp
from agentic_lora.testing.sglang_engine import Fault
from agentic_lora.testing.sglang_engine import FaultKind
from tests.publication.support import FAST
from tests.publication.support import A
from tests.publication.support import B
from tests.publication.support import C
from tests.publication.support import LinkedWorld
from tests.publication.support import ground
from tests.publication.support import publish

pytestmark = pytest.mark.asyncio


@dataclass
class World(LinkedWorld):
    reclaimer: Reclaimer
    store: Path
    sessions: dict[str, Binding] = field(default_factory=dict)

    async def bind(self, key: str) -> Binding:
        binding = await self.registry.bind_first(request_id=new_request_id(), session_key=key)
        self.sessions[key] = binding
        return binding


@pytest_asyncio.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    async with ground(tmp_path / "store") as g:
        reclaimer = Reclaimer(g.link, g.backend, g.fleet.refs, registry_retry=FAST)  # type: ignore[arg-type]
        publisher = Publisher(
            g.link,  # type: ignore[arg-type]
            g.backend,
            g.fleet.refs,
            reclaimer=reclaimer,
            on_progress=g.progress,
            registry_retry=FAST,
        )
        yield World(
            g.fleet,
            g.registry,
            g.link,
            g.backend,
            publisher,
            g.progress,
            reclaimer,
            tmp_path / "store",
        )
        await reclaimer.stop()


# --- rule 7.1-1: staged READY, one engine at a time ------------------------------------------


async def test_b_ready_on_e0_only_keeps_the_default_then_both_ready_commit_switches_to_b(
    world: World,
) -> None:
    assert await publish(world, "v1", A) is PublicationOutcome.PUBLISHED
    assert (await world.bind("s_old")).version_id == "v1"

    gate = asyncio.Event()
    world.fleet["e1"].script(EngineOp.LOAD, Fault.waiting_for(gate))
    e0_ready = world.progress.when("e0", Phase.RECORD_READY)
    publication = asyncio.create_task(world.publisher.publish("v2", B))
    await e0_ready.wait()

    # E0 has B READY, E1 is still loading: nothing switched.
    assert world.registry.peek_version("v2").ready_engines == ("e0",)  # type: ignore[union-attr]
    assert await world.default() == "v1"
    assert (await world.bind("s_mid")).version_id == "v1"
    assert not publication.done()

    gate.set()
    result = await publication
    assert result.outcome is PublicationOutcome.PUBLISHED
    assert result.commit is not None
    assert result.commit.previous_default == "v1"
    assert await world.default() == "v2"
    assert (await world.bind("s_new")).version_id == "v2"
    # Sessions bound before the commit keep A on every later turn.
    for key in ("s_old", "s_mid"):
        again = await world.registry.bind_first(request_id=new_request_id(), session_key=key)
        assert again.lora_name == world.name("v1")
    assert world.state("v1") is VersionState.RETIRED


# --- rule 7.1-2: duplicate publication and content conflict ------------------------------------


async def _footprint(world: World) -> tuple[object, ...]:
    """What a publication changes: engine calls, slots taken, the default and its revision."""
    status = await world.registry.status()
    return world.fleet.calls(), status.slots_in_use, status.default_version, status.default_revision


# The last version and an older one: a replay of the older one does not roll the default back.
@pytest.mark.parametrize(("version_id", "snapshot"), [("v2", B), ("v1", A)], ids=["last", "older"])
async def test_same_id_same_content_never_loads_twice_nor_takes_a_second_slot_nor_switches_again(
    world: World, version_id: str, snapshot: AdapterSnapshot
) -> None:
    await publish(world, "v1", A)
    await publish(world, "v2", B)
    before = await _footprint(world)
    result = await world.publisher.publish(version_id, snapshot)
    assert result.outcome is PublicationOutcome.ALREADY_PUBLISHED
    assert result.ok
    assert await _footprint(world) == before


async def test_same_id_same_content_resumes_a_pending_publication_without_a_second_slot(
    world: World,
) -> None:
    await publish(world, "v1", A)
    # A publisher that reserved v2, loaded it on E0 and then died.
    await world.registry.reserve(request_id=new_request_id(), version_id="v2", digest=B.digest)
    await world.backend.prepare(
        world.fleet.refs[0], PublicationTarget("v2", B.digest, world.name("v2"), 1), B
    )
    assert await world.slots() == 2
    result = await world.publisher.publish("v2", B)
    assert result.outcome is PublicationOutcome.PUBLISHED
    assert await world.slots() == 2
    assert world.fleet["e0"].physical_loads[world.name("v2")] == 1  # not loaded again
    assert world.fleet["e1"].physical_loads[world.name("v2")] == 1


async def _to_loading(world: World) -> None:
    await world.registry.reserve(request_id=new_request_id(), version_id="v2", digest=B.digest)


async def _to_aborted(world: World) -> None:
    world.fleet["e1"].script(EngineOp.LOAD, Fault(FaultKind.REFUSE))
    world.fleet["e1"].script(EngineOp.UNLOAD, Fault(FaultKind.REFUSE))
    assert await publish(world, "v2", B) is PublicationOutcome.BLOCKED


async def _blocked_with_e1_unconfirmed(world: World) -> PublicationResult:
    """v2 BLOCKED: e1 loaded it but the reply was lost, then e1's unload failed (unconfirmed)."""
    world.fleet["e1"].script(EngineOp.LOAD, Fault(FaultKind.LOSE_REPLY))
    world.fleet["e1"].script(EngineOp.UNLOAD, Fault(FaultKind.SERVER_ERROR))
    result = await world.publisher.publish("v2", B)
    assert result.outcome is PublicationOutcome.BLOCKED
    return result


async def _to_failed_clean(world: World) -> None:
    world.fleet["e1"].script(EngineOp.LOAD, Fault(FaultKind.REFUSE))
    assert await publish(world, "v2", B) is PublicationOutcome.FAILED_CLEAN


async def _to_published(world: World) -> None:
    await publish(world, "v2", B)


async def _to_retired(world: World) -> None:
    await publish(world, "v2", B)
    await world.bind("holder")
    await world.reclaimer.reclaim_once()  # frees v1, keeps v2 (bound)
    await publish(world, "v3", C)


async def _to_reclaiming(world: World) -> None:
    await _to_retired(world)
    await world.close("holder")
    world.fleet["e0"].script(EngineOp.UNLOAD, Fault(FaultKind.REFUSE))
    report = await world.reclaimer.reclaim_once()
    assert report.pending == ("v2",)


async def _to_reclaimed(world: World) -> None:
    await _to_retired(world)
    await world.close("holder")
    assert (await world.reclaimer.reclaim_once()).reclaimed == ("v2",)


@pytest.mark.parametrize(
    ("bring", "state"),
    [
        (_to_loading, VersionState.LOADING),
        (_to_aborted, VersionState.ABORTED),
        (_to_failed_clean, VersionState.FAILED_CLEAN),
        (_to_published, VersionState.PUBLISHED),
        (_to_retired, VersionState.RETIRED),
        (_to_reclaiming, VersionState.RECLAIMING),
        (_to_reclaimed, VersionState.RECLAIMED),
    ],
)
async def test_same_id_different_content_is_a_version_conflict_in_every_state(
    world: World, bring: Callable[[World], Any], state: VersionState
) -> None:
    await publish(world, "v1", A)
    await bring(world)
    assert world.state("v2") is state
    calls, default = world.fleet.calls(), await world.default()
    other = tiny_snapshot(99)
    with pytest.raises(VersionConflictError):
        await world.publisher.publish("v2", other)
    assert world.fleet.calls() == calls  # refused before any engine call
    assert await world.default() == default
    assert world.state("v2") is state


async def test_a_new_id_with_an_old_versions_content_is_a_new_publication(world: World) -> None:
    await publish(world, "v1", A)
    await publish(world, "v2", B)
    assert (await world.reclaimer.reclaim_once()).reclaimed == ("v1",)
    result = await world.publisher.publish("v3", A)
    assert result.outcome is PublicationOutcome.PUBLISHED
    assert result.lora_name != world.name("v1")
    assert await world.default() == "v3"
    for engine in world.fleet.engines.values():
        assert engine.held_digest(world.name("v3")) == A.digest
        assert engine.physical_loads[world.name("v3")] == 1


# --- rule 7.1-3: failures never move the default; cleanup on both before the slot is freed ------


async def test_single_engine_failure_cleans_b_on_both_engines_before_its_slot_is_freed(
    world: World,
) -> None:
    await publish(world, "v1", A)
    world.fleet["e1"].script(EngineOp.LOAD, Fault(FaultKind.REFUSE, "out of LoRA memory"))
    held = asyncio.Event()
    world.fleet["e1"].script(EngineOp.UNLOAD, Fault.waiting_for(held))
    e0_confirmed = world.progress.when("e0", Phase.CONFIRM_CLEANUP)
    publication = asyncio.create_task(world.publisher.publish("v2", B))
    await e0_confirmed.wait()

    # E0 confirmed, E1 not yet: the candidate still holds its slot.
    assert world.state("v2") is VersionState.ABORTED
    assert await world.slots() == 2
    assert not world.fleet["e0"].holds(world.name("v2"))

    held.set()
    result = await publication
    assert result.outcome is PublicationOutcome.FAILED_CLEAN
    assert world.state("v2") is VersionState.FAILED_CLEAN
    assert await world.slots() == 1
    assert await world.default() == "v1"
    reports = {r.engine: r for r in result.engines}
    assert reports["e0"].ready
    assert reports["e0"].cleaned
    assert not reports["e1"].ready
    assert reports["e1"].cleaned
    assert reports["e1"].error_code == "BACKEND_REFUSED"
    assert world.fleet["e0"].physical_unloads[world.name("v2")] == 1


async def test_one_engine_failing_never_cancels_another_engines_in_flight_load(
    world: World,
) -> None:
    await publish(world, "v1", A)
    gate = asyncio.Event()
    world.fleet["e0"].script(EngineOp.LOAD, Fault.waiting_for(gate))
    world.fleet["e1"].script(EngineOp.LOAD, Fault(FaultKind.REFUSE))
    e1_failed = world.progress.when("e1", Phase.PREPARE, PhaseStatus.FAILED)
    publication = asyncio.create_task(world.publisher.publish("v2", B))
    await e1_failed.wait()
    assert not publication.done()
    gate.set()
    assert (await publication).outcome is PublicationOutcome.FAILED_CLEAN
    # E0's load ran to its end (it was not cancelled into an unknown state) and was then undone.
    assert world.fleet["e0"].physical_loads[world.name("v2")] == 1
    assert world.fleet["e0"].physical_unloads[world.name("v2")] == 1


async def test_manifest_mismatch_on_one_engine_fails_clean_on_both(world: World) -> None:
    await publish(world, "v1", A)
    lora_name = make_lora_name("policy_lora", 0, "v2", B.digest)
    C.write_peft_dir(world.store / "e1" / lora_name)  # E1's stored copy holds other bytes
    loads = world.fleet["e1"].count(EngineOp.LOAD)
    result = await world.publisher.publish("v2", B)
    assert result.outcome is PublicationOutcome.FAILED_CLEAN
    assert {r.engine: r.error_code for r in result.engines}["e1"] == "BACKEND_REFUSED"
    assert world.fleet["e1"].count(EngineOp.LOAD) == loads  # never asked to load bad bytes
    assert not (world.store / "e1" / lora_name).exists()
    assert not world.fleet["e0"].holds(lora_name)
    assert await world.default() == "v1"
    assert await world.slots() == 1


async def test_lost_load_ack_fails_clean_and_unloads_what_the_engine_did_load(world: World) -> None:
    await publish(world, "v1", A)
    world.fleet["e0"].script(EngineOp.LOAD, Fault(FaultKind.LOSE_REPLY))
    result = await world.publisher.publish("v2", B)
    assert result.outcome is PublicationOutcome.FAILED_CLEAN
    name = world.name("v2")
    assert {r.engine: r.error_code for r in result.engines}["e0"] == "BACKEND_AMBIGUOUS"
    assert world.fleet["e0"].physical_loads[name] == 1
    assert world.fleet["e0"].physical_unloads[name] == 1
    assert not world.fleet["e1"].holds(name)
    assert await world.default() == "v1"
    assert await world.slots() == 1


async def test_engine_restart_mid_publication_invalidates_its_ready_and_fails_clean(
    world: World,
) -> None:
    await publish(world, "v1", A)
    # E1 answers READY for B, then its process restarts before the commit.
    world.fleet["e1"].script(EngineOp.GENERATE, Fault(FaultKind.RESTART_AFTER))
    result = await world.publisher.publish("v2", B)
    assert result.outcome is PublicationOutcome.FAILED_CLEAN
    assert "NOT_READY" in (result.reason or "")
    assert await world.default() == "v1"
    name = world.name("v2")
    assert not world.fleet["e0"].holds(name)
    assert not world.fleet["e1"].holds(name)
    assert world.fleet["e0"].physical_unloads[name] == 1
    assert await world.slots() == 1
    status = await world.registry.status()
    assert {e.engine: e.incarnation for e in status.engines}[
        "e1"
    ] == await world.backend.incarnation(world.fleet.refs[1])


async def test_a_restart_nobody_observed_before_the_publication_is_observed_by_it(
    world: World,
) -> None:
    await publish(world, "v1", A)
    registry_before = {e.engine: e.incarnation for e in (await world.registry.status()).engines}
    # E1 restarted between publications; no repairer ran, so the registry still holds the old
    # process. The prepare reads the new one before its load; the READY it carries is refused
    # once, a fresh read confirms it is current, and the publication goes through.
    world.fleet["e1"].restart()
    result = await world.publisher.publish("v2", B)
    assert result.outcome is PublicationOutcome.PUBLISHED
    assert await world.default() == "v2"
    current = await world.backend.incarnation(world.fleet.refs[1])
    assert current != registry_before["e1"]
    status = await world.registry.status()
    assert {e.engine: e.incarnation for e in status.engines}["e1"] == current
    assert world.state("v2") is VersionState.PUBLISHED
    # Only E1 needed the second read: E0's READY was recorded at once.
    observed = [t.engine for t in result.timings if t.phase is Phase.OBSERVE]
    assert observed.count("e1") == 2
    assert observed.count("e0") == 1


async def test_a_publication_reads_no_incarnation_before_its_prepare(world: World) -> None:
    await publish(world, "v1", A)
    result = await world.publisher.publish("v2", B)
    assert result.outcome is PublicationOutcome.PUBLISHED
    # Per engine: prepare, record_ready, then the one observe right before the commit.
    for engine in ("e0", "e1"):
        phases = [t.phase for t in result.timings if t.engine == engine]
        assert phases.index(Phase.PREPARE) < phases.index(Phase.OBSERVE)
        assert phases.count(Phase.OBSERVE) == 1


async def test_the_check_before_commit_reads_the_listing_and_still_catches_a_restart(
    world: World,
) -> None:
    await publish(world, "v1", A)
    server_info = world.fleet.calls(EngineOp.SERVER_INFO)
    assert await publish(world, "v2", B) is PublicationOutcome.PUBLISHED
    # Both engines held v1 and still listed it: neither /server_info was needed.
    assert world.fleet.calls(EngineOp.SERVER_INFO) == server_info
    # A restart after E1's READY: the listing lacks what E1 held, so the check reads the
    # fingerprint, the registry drops the READY and the commit is refused.
    world.fleet["e1"].script(EngineOp.GENERATE, Fault(FaultKind.RESTART_AFTER))
    result = await world.publisher.publish("v3", C)
    assert result.outcome is PublicationOutcome.FAILED_CLEAN
    assert await world.default() == "v2"


# --- lost and unknown registry replies ----------------------------------------------------------


async def test_a_lost_commit_reply_is_retried_with_the_same_request_id(world: World) -> None:
    await publish(world, "v1", A)
    revision = (await world.registry.status()).default_revision
    world.link.drop["commit"] = 1
    result = await world.publisher.publish("v2", B)
    assert result.outcome is PublicationOutcome.PUBLISHED
    commits = [rid for verb, rid in world.link.seen if verb == "commit"]
    assert len(commits) == 3
    assert commits[1] == commits[2]
    assert (await world.registry.status()).default_revision == revision + 1
    assert result.commit is not None
    assert result.commit.default_revision == revision + 1


async def test_a_commit_whose_outcome_stays_unknown_blocks_and_never_cleans(world: World) -> None:
    await publish(world, "v1", A)
    world.link.drop["commit"] = FAST.attempts
    result = await world.publisher.publish("v2", B)
    assert result.outcome is PublicationOutcome.BLOCKED
    name = world.name("v2")
    # B may be the default (here it is): it must still be loaded everywhere.
    assert world.fleet.calls(EngineOp.UNLOAD) == 0
    assert world.fleet["e0"].holds(name)
    assert world.fleet["e1"].holds(name)
    # Publishing the same version again learns the outcome.
    assert await publish(world, "v2", B) is PublicationOutcome.ALREADY_PUBLISHED
    assert await world.default() == "v2"


async def test_an_unconfirmed_cleanup_keeps_the_slot_and_blocks_until_resolved(
    world: World,
) -> None:
    await publish(world, "v1", A)
    result = await _blocked_with_e1_unconfirmed(world)
    assert {r.engine: r.cleaned for r in result.engines} == {"e0": True, "e1": False}
    assert world.state("v2") is VersionState.ABORTED
    assert await world.slots() == 2  # unknown is never treated as released
    calls = world.fleet.calls()
    with pytest.raises(PublicationBlockedError):
        await world.publisher.publish("v3", C)
    assert world.fleet.calls() == calls

    resolved = await world.publisher.resolve("v2")
    assert resolved.outcome is PublicationOutcome.FAILED_CLEAN
    assert [r.engine for r in resolved.engines] == ["e1"]  # E0 had confirmed already
    assert not world.fleet["e1"].holds(world.name("v2"))
    assert await world.slots() == 1
    assert await publish(world, "v3", C) is PublicationOutcome.PUBLISHED


async def test_resolve_counts_a_restarted_engine_as_cleaned_without_calling_it(
    world: World,
) -> None:
    await publish(world, "v1", A)
    await _blocked_with_e1_unconfirmed(world)
    assert world.publisher.abandoned == {"v2"}
    world.fleet["e1"].restart()
    unloads = world.fleet["e1"].count(EngineOp.UNLOAD)

    resolved = await world.publisher.resolve("v2")
    assert resolved.outcome is PublicationOutcome.FAILED_CLEAN
    assert [(r.engine, r.cleaned) for r in resolved.engines] == [("e1", True)]
    assert world.fleet["e1"].count(EngineOp.UNLOAD) == unloads
    assert any(t.engine == "e1" and t.phase is Phase.OBSERVE for t in resolved.timings)
    assert not any(t.phase is Phase.CLEANUP for t in resolved.timings)
    assert world.publisher.abandoned == set()


async def test_resolve_cleans_an_engine_whose_incarnation_cannot_be_read(world: World) -> None:
    await publish(world, "v1", A)
    await _blocked_with_e1_unconfirmed(world)
    world.fleet["e1"].script(EngineOp.SERVER_INFO, Fault(FaultKind.UNREACHABLE))
    resolved = await world.publisher.resolve("v2")
    # Unknown is not proof: the cleanup call decides, and here it confirms.
    assert resolved.outcome is PublicationOutcome.FAILED_CLEAN
    assert any(t.engine == "e1" and t.phase is Phase.OBSERVE and not t.ok for t in resolved.timings)
    assert not world.fleet["e1"].holds(world.name("v2"))
    again = await world.publisher.resolve("v2")
    assert (again.outcome, again.reason) == (
        PublicationOutcome.FAILED_CLEAN,
        "nothing to resolve: FAILED_CLEAN",
    )


async def test_resolve_aborts_a_publication_left_loading(world: World) -> None:
    await publish(world, "v1", A)
    await _to_loading(world)
    result = await world.publisher.resolve("v2")
    assert result.outcome is PublicationOutcome.FAILED_CLEAN
    assert world.state("v2") is VersionState.FAILED_CLEAN
    # The same version can be published again as a new attempt.
    again = await world.publisher.publish("v2", B)
    assert again.outcome is PublicationOutcome.PUBLISHED
    assert again.attempt == 2


# --- bootstrap and capacity -------------------------------------------------------------------


async def test_a_failed_bootstrap_publication_is_fatal(world: World) -> None:
    world.fleet["e0"].script(EngineOp.LOAD, Fault(FaultKind.REFUSE))
    with pytest.raises(BackendRefusedError) as info:
        await world.publisher.publish("v1", A)
    assert info.value.details["result"].outcome is PublicationOutcome.FAILED_CLEAN
    assert await world.default() is None


async def test_an_ambiguous_bootstrap_publication_is_fatal(world: World) -> None:
    world.fleet["e0"].script(EngineOp.LOAD, Fault(FaultKind.LOSE_REPLY))
    world.fleet["e0"].script(EngineOp.UNLOAD, Fault(FaultKind.UNREACHABLE))
    with pytest.raises(BackendAmbiguousError):
        await world.publisher.publish("v1", A)


async def test_capacity_refusal_after_bootstrap_is_a_skip_with_zero_engine_calls(
    world: World,
) -> None:
    await publish(world, "v1", A)
    await world.bind("s_a")
    await publish(world, "v2", B)
    calls = world.fleet.calls()
    result = await world.publisher.publish("v3", C)
    assert result.outcome is PublicationOutcome.SKIPPED
    assert result.reason == "CAPACITY_ERROR"
    assert not result.ok
    assert world.fleet.calls() == calls
    assert await world.default() == "v2"
    assert world.registry.peek_version("v3") is None  # the registry never saw it


async def test_a_skipped_publication_yields_so_a_publishing_loop_cannot_starve_the_rest(
    world: World,
) -> None:
    # A trainer publishing back to back while every slot is held must still let the Sessions
    # that hold the slots (and the reclaimer) run, or no slot is ever freed: a livelock.
    await publish(world, "v1", A)
    await world.bind("s_a")
    await publish(world, "v2", B)
    turns = 0

    async def other_work() -> None:
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    other = asyncio.create_task(other_work())
    await asyncio.sleep(0)  # the other task starts: turns == 1
    before = turns
    for n in range(3):
        result = await world.publisher.publish(f"v{3 + n}", C)
        assert result.outcome is PublicationOutcome.SKIPPED
        assert turns > before, "a skipped publication returned without yielding"
        before = turns
    other.cancel()
    with pytest.raises(asyncio.CancelledError):
        await other


# --- progress and timings ---------------------------------------------------------------------


async def test_results_carry_per_engine_per_phase_timings_and_progress_events(world: World) -> None:
    result = await world.publisher.publish("v1", A)
    for engine in ("e0", "e1"):
        for phase in (Phase.OBSERVE, Phase.PREPARE, Phase.RECORD_READY):
            assert any(t.engine == engine and t.phase is phase and t.ok for t in result.timings)
            assert result.seconds(phase, engine) >= 0.0
    assert any(t.engine is None and t.phase is Phase.COMMIT for t in result.timings)
    prepare_e0 = [
        e.status for e in world.progress.events if (e.engine, e.phase) == ("e0", Phase.PREPARE)
    ]
    assert prepare_e0 == [PhaseStatus.STARTED, PhaseStatus.DONE]
    assert {e.version_id for e in world.progress.events} == {"v1"}


async def test_a_failing_progress_callback_does_not_fail_the_publication(world: World) -> None:
    def broken(event: PhaseEvent) -> None:
        raise RuntimeError("display gone")

    publisher = Publisher(world.registry, world.backend, world.fleet.refs, on_progress=broken)
    assert (await publisher.publish("v1", A)).outcome is PublicationOutcome.PUBLISHED


async def test_a_run_has_no_attempt_before_its_reservation(world: World) -> None:
    # Every step after the reservation reads the attempt from the run: one reached before it
    # is a bug in the publisher, named as such rather than an AttributeError on None.
    run = PublicationRun("v1", A.digest, bootstrap=True, recorder=PhaseRecorder(lambda: 0.0, None))
    with pytest.raises(RuntimeError, match="no attempt reserved yet"):
        _ = run.attempt
    assert await publish(world, "v1", A) is PublicationOutcome.PUBLISHED
    ref = (await world.registry.version("v1")).ref
    run.target = ref
    assert run.attempt is ref
