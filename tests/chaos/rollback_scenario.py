"""Rollback under load, on real engines: the scenario the chaos test asserts and ``bench/chaos.py``
times (see ``tests/chaos/test_rollback_under_load.py``).

Topology: in-process, as the engine fault's (:func:`tests.chaos.scenarios.engine_restart`): a
:class:`~agentic_lora.assembly.deployment.Deployment` with a journaled LocalRegistry drives the
shared two-engine fleet through one :class:`~tests.chaos.support.EngineTap` per engine; eight
example agents run tool-using episodes on its Sessions the whole time.

1. A, then B are published under load. Two agents are parked between two turns of a Session
   bound to A, so A is RETIRED and held.
2. **Rollback to a RETIRED version**: A becomes the default again (nothing transferred). The
   parked agents go on, on A; B's Sessions go on, on B; new Sessions bind A.
3. B is retired; once its Sessions are gone the reclaimer unloads it (RECLAIMED).
4. **Rollback to a RECLAIMED version**: B is loaded again (a new attempt of the same content
   under the same adapter name) and becomes the default again.
5. More traffic, then the load stops and the registry settles.

Verdicts (``FaultReport.problems``): no Session's requests reached two adapters, as the engines
received them, and none fell back to the base model; 0 failed requests; both rollbacks PUBLISHED
with ``commit.rollback`` and the expected origin; every episode that started after a rollback
and before the next one ran the rolled-back version and its provenance names the origin; every
publication stays committed, slots are exactly the versions holding one; the settled registry
has nothing RETIRED, RECLAIMING, LOADING or pending.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from pathlib import Path

from agentic_lora_harness.engines import EngineFleet

from agentic_lora.adapters.snapshot import AdapterSnapshot
from agentic_lora.publication.result import PublicationOutcome
from agentic_lora.publication.result import PublicationResult
from agentic_lora.registry.types import VersionState
from tests.chaos.scenarios import AGENTS
from tests.chaos.scenarios import FaultReport
from tests.chaos.scenarios import _settle as settle
from tests.chaos.scenarios import reclaim_events
from tests.chaos.scenarios import tapped_deployment
from tests.chaos.scenarios import taps_on
from tests.chaos.support import GUARD_SECONDS
from tests.chaos.support import AgentLoad
from tests.chaos.support import VersioningSource
from tests.chaos.support import ledger_problems
from tests.chaos.support import now
from tests.chaos.support import nth_generation
from tests.chaos.support import wire_problems
from tests.e2e.recording_proxy import TrafficLog

__all__ = ["rollback_under_load"]

#: Agents parked on A across the first rollback (so A is RETIRED and held when it happens).
PARKED = (0, 1)


async def rollback_under_load(
    fleet: EngineFleet, workdir: Path, rng: random.Random, *, name: str = "rollback"
) -> FaultReport:
    """Run the scenario (see the module docstring); what it measured and every problem."""
    report = FaultReport(fault="rollback under load", seed_name=name)
    # The seeded choice: how many generations of B's Sessions run before the first rollback.
    on_b = rng.randint(2, 8)
    report.choices = {"generations_on_b": on_b}
    tag = uuid.uuid4().hex[:6]
    a_id, b_id = f"A-{tag}", f"B-{tag}"
    traffic = TrafficLog()
    snapshots = {x: AdapterSnapshot.from_peft_dir(fleet.fixture.adapter(x)) for x in "AB"}
    rollbacks: list[tuple[str, float, float, PublicationResult]] = []
    async with taps_on(fleet, traffic) as taps:
        deployment = tapped_deployment(taps, fleet, workdir)
        reclaimed = reclaim_events(deployment)
        async with deployment:

            async def publish(version_id: str, letter: str) -> None:
                result = await deployment.publish(version_id, snapshots[letter])
                if result.outcome is not PublicationOutcome.PUBLISHED:
                    raise AssertionError(f"publication of {version_id}: {result}")

            async def roll_back(version_id: str) -> PublicationResult:
                start = now()
                result = await deployment.rollback(version_id)
                rollbacks.append((version_id, start, now(), result))
                return result

            async def state_of(version_id: str) -> VersionState:
                return (await deployment.registry.version(version_id)).state

            await publish(a_id, "A")
            source = VersioningSource(deployment.versioning)
            load = AgentLoad(source, agents=AGENTS, prefix=f"r{tag}")
            load.start()
            try:
                await nth_generation(traffic, AGENTS, since=traffic.mark("load on A"))
                parked = await load.hold(PARKED, on_version=a_id)
                await publish(b_id, "B")
                await nth_generation(traffic, on_b, since=traffic.mark("B"), tag_prefix=f"r{tag}")
                # 2. A is RETIRED and held by the parked Sessions: rolled back in place.
                report.choices["a_state_at_rollback"] = (await state_of(a_id)).value
                await roll_back(a_id)
                load.release()
                await nth_generation(traffic, AGENTS, since=traffic.mark("after the rollback to A"))
                # 3-4. B's Sessions end, the reclaimer unloads B; then the rollback reloads it.
                b_gone = reclaimed.setdefault(b_id, asyncio.Event())
                await asyncio.wait_for(b_gone.wait(), GUARD_SECONDS)
                report.choices["b_state_at_rollback"] = VersionState.RECLAIMED.value
                await roll_back(b_id)
                await nth_generation(traffic, AGENTS, since=traffic.mark("after the rollback to B"))
            finally:
                await load.stop()
            final = await settle(deployment.registry.status, what="registry after the load")
            report.problems += ledger_problems(final, [a_id, b_id])
        report.problems += wire_problems(taps, traffic)
    report.requests = len(load.attempts)
    report.episodes = len(load.episodes)
    report.publications = {"published": 2, "rollbacks": len(rollbacks)}
    report.problems += [f"agent loop error: {e}" for e in load.errors]
    failed = load.failed()
    report.failures = {
        "during": [f"{a.session_id} {a.outcome.value} {a.error_code}" for a in failed]
    }
    report.times["failed_requests"] = float(len(failed))
    if failed:
        report.problems.append(f"{len(failed)} requests failed: {report.failures['during'][:8]}")
    origins = {a_id: b_id, b_id: a_id}
    for version_id, start, end, result in rollbacks:
        key = "retired" if version_id == a_id else "reclaimed"
        report.times[f"rollback_{key}_s"] = round(end - start, 3)
        # Back to normal: a Session opened after the rollback served (on the rolled-back version).
        served = [
            e.attempts[0].started_at + e.attempts[0].latency_s
            for e in load.episodes
            if e.attempts and e.attempts[0].started_at > end
        ]
        report.times[f"new_session_served_after_{key}_s"] = (
            round(min(served) - start, 3) if served else None
        )
        commit = result.commit
        if (
            result.outcome is not PublicationOutcome.PUBLISHED
            or commit is None
            or not commit.rollback
            or commit.previous_default != origins[version_id]
        ):
            report.problems.append(f"rollback to {version_id}: {result}")
    names = {v: deployment.registry.peek_version(v).lora_name for v in (a_id, b_id)}  # type: ignore[attr-defined]
    report.problems += _episode_problems(load, rollbacks, parked, names[a_id], names, origins)
    report.back_s = report.times.get("new_session_served_after_retired_s")
    report.first_publication_s = report.times.get("rollback_retired_s")
    report.goals = {
        "no Session changed version": not any("adapters" in p for p in report.problems),
        "0 failed requests": not failed,
    }
    return report


def _episode_problems(
    load: AgentLoad,
    rollbacks: list[tuple[str, float, float, PublicationResult]],
    parked: set[str],
    parked_on: str,
    names: dict[str, str],
    origins: dict[str, str],
) -> list[str]:
    """Episodes that started between one rollback's end and the next one's start ran the
    rolled-back version, and their provenance names where it came back from; the parked
    Sessions kept the version they bound (``parked_on``, an adapter name)."""
    problems: list[str] = []
    windows = [
        (version_id, end, rollbacks[i + 1][1] if i + 1 < len(rollbacks) else float("inf"))
        for i, (version_id, _start, end, _result) in enumerate(rollbacks)
    ]
    checked = 0
    for episode in load.episodes:
        first = episode.attempts[0] if episode.attempts else None
        if episode.session_id in parked:
            if episode.lora_names != {parked_on}:
                problems.append(f"parked Session {episode.session_id} ran {episode.lora_names}")
            continue
        if first is None:
            continue
        for version_id, after, before in windows:
            if after < first.started_at < before:
                checked += 1
                provenance = episode.provenance or {}
                if episode.lora_names != {names[version_id]}:
                    problems.append(
                        f"{episode.session_id} started after the rollback to {version_id} but "
                        f"ran {sorted(episode.lora_names)}"
                    )
                elif provenance.get("rolled_back_from") != origins[version_id]:
                    problems.append(
                        f"{episode.session_id} on {version_id}: provenance {provenance}"
                    )
    if not checked:
        problems.append("no episode started after a rollback: nothing checked")
    return problems
