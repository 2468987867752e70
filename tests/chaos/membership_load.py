"""Engines added and drained under agent load, on real engines: the scenario the chaos test
asserts and ``bench/chaos.py`` times (``engine-add``, ``engine-drain``; see
``tests/chaos/test_membership_under_load.py``).

Topology: in-process, as the engine fault's (:func:`tests.chaos.scenarios.engine_restart`): a
:class:`~agentic_lora.assembly.deployment.Deployment` with a journaled LocalRegistry drives the
shared two-engine fleet through one :class:`~tests.chaos.support.EngineTap` per engine, both
configured; eight example agents run multi-turn tool-using episodes on its Sessions throughout.

* **add** (the fleet starts with one member: the other configured engine is drained and removed
  before anything is published): once the agents run on the member, the other engine is added
  (``Deployment.add_engine``). While its versions load, a publication runs (its trainer-visible
  time is measured). The engine becomes ACTIVE holding every dispatchable version, and serves
  new Sessions.
* **drain**: once the agents run on both members, one that is serving is drained
  (``Deployment.drain_engine``), with a publication during the drain. No request starts on it
  from the drain on; its Sessions go on, on their version, on the other member; once its
  in-flight requests ended it is REMOVED.

With both changes (the test), the drain takes the original member out once the added engine
serves and the version the add left retired has been reclaimed (so the drain's publication has a
slot). Times are seconds on one monotonic clock from the membership call: ``back_s`` until the
engine is ACTIVE and served a generation (add) or REMOVED (drain); ``first_publication_s`` is
the duration of the publish call made during the change.

Verdicts (``FaultReport.problems``): 0 failed requests; no Session's requests reached two
adapters, or none (the engines' wire); the added engine received no generation for an adapter
before that adapter was loaded onto it, and none before it was ACTIVE; no request started on a
drained engine after its drain; the publication during each change PUBLISHED; the membership is
what was asked; once the load stopped and the registry settled, no Session ref is left, slots are
exactly the versions holding one, and every publication stays committed.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agentic_lora_harness.engines import EngineFleet

from agentic_lora.adapters.snapshot import AdapterSnapshot
from agentic_lora.assembly.deployment import Deployment
from agentic_lora.assembly.membership import DrainOutcome
from agentic_lora.publication.result import PublicationOutcome
from agentic_lora.registry.types import MemberState
from tests.chaos.scenarios import AGENTS
from tests.chaos.scenarios import FaultReport
from tests.chaos.scenarios import _settle as settle
from tests.chaos.scenarios import reclaim_events
from tests.chaos.scenarios import tapped_deployment
from tests.chaos.scenarios import taps_on
from tests.chaos.support import GUARD_SECONDS
from tests.chaos.support import AgentLoad
from tests.chaos.support import VersioningSource
from tests.chaos.support import is_generation
from tests.chaos.support import ledger_problems
from tests.chaos.support import now
from tests.chaos.support import nth_generation
from tests.chaos.support import served_before_loaded
from tests.chaos.support import session_tag
from tests.chaos.support import wire_problems
from tests.e2e.recording_proxy import TrafficLog

__all__ = ["MEMBERSHIP_FAULTS", "membership_fault", "membership_under_load"]

#: ``bench/chaos.py`` fault kinds -> the changes their run makes.
MEMBERSHIP_FAULTS = {"engine-add": ("add",), "engine-drain": ("drain",)}


class Applied:
    """When the registry applied a verb (once armed): the time, a traffic mark, an event."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.at = 0.0
        self.mark = 0

    def seen(self, traffic: TrafficLog) -> None:
        self.at = now()
        self.mark = traffic.mark("registry step")
        self.event.set()


async def membership_under_load(
    fleet: EngineFleet,
    workdir: Path,
    rng: random.Random,
    *,
    changes: Sequence[str] = ("add", "drain"),
    name: str = "membership",
) -> FaultReport:
    """Run the scenario (see the module docstring); what it measured and every problem."""
    report = FaultReport(fault="engine " + " then ".join(changes) + " under load", seed_name=name)
    began = now()
    first, second = rng.sample(list(fleet.names), 2)
    report.choices = {"changes": list(changes), "first": first, "second": second}
    tag = uuid.uuid4().hex[:6]
    traffic = TrafficLog()
    snapshots = {x: AdapterSnapshot.from_peft_dir(fleet.fixture.adapter(x)) for x in "ABC"}
    letters = iter("ABC")
    committed: list[str] = []
    async with taps_on(fleet, traffic) as taps:
        deployment = tapped_deployment(taps, fleet, workdir)
        applied: dict[str, Applied] = {}

        def on_change(verb: str, result: Any) -> None:
            if verb in applied and not applied[verb].event.is_set():
                applied[verb].seen(traffic)

        reclaimed = reclaim_events(deployment, also=on_change)

        async def publish() -> tuple[str, float, PublicationOutcome]:
            letter = next(letters)
            version_id = f"{letter}-{tag}"
            start = now()
            result = await deployment.publish(version_id, snapshots[letter])
            if result.outcome is PublicationOutcome.PUBLISHED:
                committed.append(version_id)
            return version_id, round(now() - start, 3), result.outcome

        async with deployment:
            if "add" in changes:
                # The fleet starts with one member; `second` is configured but not one of them.
                start = await deployment.drain_engine(second)
                if start.outcome is not DrainOutcome.REMOVED:
                    raise AssertionError(f"{second} could not be taken out at the start: {start}")
            await publish()
            source = VersioningSource(deployment.versioning)
            load = AgentLoad(source, agents=AGENTS, prefix=f"m{tag}")
            load.start()
            try:
                await nth_generation(traffic, AGENTS, since=traffic.mark("load on one member"))
                if "add" in changes:
                    await _add(deployment, second, traffic, load, publish, report, applied)
                if "drain" in changes:
                    victim = first
                    if "add" in changes:
                        # The drain's publication needs a slot: the version the add retired
                        # goes once its Sessions ended.
                        retired = committed[0]
                        gone = reclaimed.setdefault(retired, asyncio.Event())
                        await asyncio.wait_for(gone.wait(), GUARD_SECONDS)
                    await _drain(deployment, victim, traffic, load, publish, report, applied)
                await nth_generation(traffic, AGENTS, since=traffic.mark("after the changes"))
            finally:
                await load.stop()
            final = await settle(deployment.registry.status, what="registry after the load")
            report.problems += ledger_problems(final, committed)
            if final.live_sessions or any(v.session_refs for v in final.versions):
                report.problems.append(
                    f"Session refs left after every Session closed: {final.live_sessions} live, "
                    + ", ".join(f"{v.version_id}={v.session_refs}" for v in final.versions)
                )
            members = {e.engine: e.membership for e in final.engines}
            expected = {first: MemberState.ACTIVE, second: MemberState.ACTIVE}
            if "drain" in changes:
                del expected[first]
            if members != expected:
                report.problems.append(f"membership at the end {members}, not {expected}")
        report.problems += wire_problems(taps, traffic)
        if "add" in changes:
            exchanges = list(traffic.exchanges)
            since = int(report.choices["add_mark"])
            for g in served_before_loaded(exchanges, second, since):
                report.problems.append(f"{second} served {g.lora} before it was loaded there")
            active = applied["activate_engine"].mark
            early = [
                g
                for g in exchanges
                if g.engine == second
                and is_generation(g)
                and session_tag(g) is not None  # a Session's, not a load's probe
                and since < g.seq_sent < active
            ]
            if early:
                report.problems.append(f"{second} received {len(early)} generations before ACTIVE")
    report.times["scenario_s"] = round(now() - began, 1)
    report.requests = len(load.attempts)
    report.episodes = len(load.episodes)
    report.publications = {"published": len(committed)}
    report.problems += [f"agent loop error: {e}" for e in load.errors]
    failed = load.failed()
    report.failures = {
        "during": [f"{a.session_id} {a.outcome.value} {a.error_code}" for a in failed]
    }
    report.times["failed_requests"] = float(len(failed))
    if failed:
        report.problems.append(f"{len(failed)} requests failed: {report.failures['during'][:8]}")
    report.goals = {
        "0 failed requests": not failed,
        "no Session changed version": not any("adapters" in p for p in report.problems),
    }
    return report


async def _add(
    deployment: Deployment,
    engine: str,
    traffic: TrafficLog,
    load: AgentLoad,
    publish: Any,
    report: FaultReport,
    applied: dict[str, Applied],
) -> None:
    """Add ``engine`` under load, with a publication while its versions load."""
    report.choices["add_mark"] = traffic.mark(f"{engine} added")
    applied["activate_engine"] = Applied()
    start = now()
    adding = asyncio.create_task(deployment.add_engine(engine))
    await traffic.wait_for(
        lambda e: e.engine == engine and e.path == "/load_lora_adapter",
        what=f"a load onto {engine}",
    )
    version_id, took, outcome = await publish()
    report.times["add_publication_s"] = took
    if outcome is not PublicationOutcome.PUBLISHED:
        report.problems.append(f"publication of {version_id} during the add: {outcome.value}")
    state = await adding
    active_at = now()
    report.times["add_active_s"] = round(active_at - start, 3)
    if state is not MemberState.ACTIVE:
        report.problems.append(f"{engine} is {state.value} after add_engine")
    served = await load.progress.wait_for(
        lambda a: a.outcome.value == "ok" and a.engine == engine and a.started_at > active_at,
        what=f"{engine} serving a generation once ACTIVE",
    )
    report.back_s = round(served.started_at + served.latency_s - start, 3)
    report.first_publication_s = took


async def _drain(
    deployment: Deployment,
    engine: str,
    traffic: TrafficLog,
    load: AgentLoad,
    publish: Any,
    report: FaultReport,
    applied: dict[str, Applied],
) -> None:
    """Drain ``engine`` while it serves, with a publication during the drain."""
    # The drain starts while a Session's generation is on the engine: one it must wait for.
    mark = traffic.mark(f"before draining {engine}")
    await traffic.wait_for(
        lambda e: (
            e.engine == engine
            and is_generation(e)
            and session_tag(e) is not None
            and e.seq_sent > mark
            and not e.done
        ),
        what=f"a Session's generation on {engine}",
    )
    drained = applied["drain_engine"] = Applied()
    start = now()
    draining = asyncio.create_task(deployment.drain_engine(engine))
    await drained.event.wait()
    drained_at = drained.at
    version_id, took, outcome = await publish()
    report.times["drain_publication_s"] = took
    if outcome is not PublicationOutcome.PUBLISHED:
        report.problems.append(f"publication of {version_id} during the drain: {outcome.value}")
    result = await draining
    report.back_s = round(now() - start, 3)
    report.first_publication_s = took
    report.times["drain_waited_s"] = round(result.waited_s, 3)
    report.choices["drain"] = result.as_json()
    if result.outcome is not DrainOutcome.REMOVED:
        report.problems.append(f"drain of {engine}: {result}")
    late = [a for a in load.attempts if a.engine == engine and a.started_at > drained_at]
    if late:
        report.problems.append(f"{len(late)} requests started on {engine} after its drain")


async def membership_fault(
    kind: str, fleet: EngineFleet, workdir: Path, rng: random.Random, name: str, started: float
) -> dict[str, Any]:
    """One ``bench/chaos.py`` run of ``engine-add`` or ``engine-drain`` (begun at ``started`` on
    ``time.monotonic``), as its table reads it: ``back_s`` (the engine ACTIVE and serving, or
    REMOVED), ``first_publication_s`` (the publish call during the change), the failed requests
    (``times["failed_requests"]``; goal 0), and the goals."""
    report = await membership_under_load(
        fleet, workdir, rng, changes=MEMBERSHIP_FAULTS[kind], name=name
    )
    out = report.as_dict()
    out["kind"] = kind
    out["wall_s"] = round(time.monotonic() - started, 1)
    return out
