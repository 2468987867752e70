"""A hung engine (SIGSTOP) under agent load and during a publication, on real engines: the scenario
the chaos test asserts and ``bench/chaos.py`` times (see ``tests/chaos/test_hung_engine.py``).

A hung engine is alive and accepts TCP (the kernel completes the handshake) but answers nothing:
what a GPU hang or a stuck collective looks like. SIGSTOP of the engine's whole process group
plays it exactly.

Topology: in-process, as the engine fault's (:func:`tests.chaos.scenarios.engine_restart`): a
:class:`~agentic_lora.assembly.deployment.Deployment` with a journaled LocalRegistry drives the
shared two-engine fleet through one :class:`~tests.chaos.support.EngineTap` per engine; eight
example agents run multi-turn tool-using episodes on its Sessions the whole time. The backend's
per-engine load timeout is :data:`LOAD_TIMEOUT` (600 s), so a publication that returns before it
did not wait for the hung engine's load.

1. A is published; the agents run on it.
2. **Hung during dispatch.** After a seeded number of the victim's answered generations, the
   victim is stopped the moment its tap receives the next generation, before the tap forwards it:
   that turn is in flight on a stopped engine, whatever the timing.
3. **Hung during a publication.** Right after the stop, the trainer publishes B. It waits for
   the victim until its probes have failed for ``eject_after``, then commits over the live member
   and reports the victim ``ENGINE_EJECTED``.
4. Every turn hung on the victim ends ``REQUEST_INDETERMINATE`` at ``request_timeout``; the
   Sessions go on on the other engine meanwhile.
5. **A second publication while it is still hung.** Once A's last Session is gone, C is
   published: both slots are held (B, and A, whose reclaim cannot finish on the hung engine), so
   it is SKIPPED for capacity at once, never after the hung engine's unload timeout.
6. **SIGCONT.** The victim answers again; the repairer loads B onto it, and only then is it
   activated: ACTIVE, routable, READY for the default. It serves a generation again. C is
   published again: A's reclaim finishes on the victim and C commits on both engines.

Verdicts (``FaultReport.problems``): B PUBLISHED with the victim ``ENGINE_EJECTED`` and the live
member READY; C SKIPPED for capacity while the victim hung (A RECLAIMING), then PUBLISHED after
the rejoin with A RECLAIMED and C READY on both; the victim EJECTED, then ACTIVE again only
after a successful load of B onto it;
every failed request is an indeterminate one on the victim that was in flight at the stop or sent
before the product took the victim out of routing (none on the live engine, none later); the
turn in flight at the stop is one of them; no Session's requests reached two adapters or the base
model; the victim received no generation for B before B was loaded onto it; the ledger holds
and settles; the final status has the victim READY for the default.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentic_lora_agent import AttemptOutcome
from agentic_lora_harness.engines import EngineFleet

from agentic_lora.adapters.snapshot import AdapterSnapshot
from agentic_lora.assembly.deployment import Deployment
from agentic_lora.config import AgenticLoRASettings
from agentic_lora.config import load_settings
from agentic_lora.engines.admin import AdminTimeouts
from agentic_lora.errors import CapacityError
from agentic_lora.errors import RequestIndeterminateError
from agentic_lora.publication.ejection import ENGINE_EJECTED
from agentic_lora.publication.result import PublicationOutcome
from agentic_lora.publication.result import PublicationResult
from agentic_lora.registry.api import change_feed
from agentic_lora.registry.types import MemberState
from agentic_lora.registry.types import RegistryStatus
from agentic_lora.registry.types import VersionState
from agentic_lora.registry.types import VersionStatus
from tests.chaos.scenarios import AGENTS
from tests.chaos.scenarios import FaultReport
from tests.chaos.scenarios import _settle as settle
from tests.chaos.scenarios import _watch_health as watch_health
from tests.chaos.scenarios import taps_on
from tests.chaos.support import AgentLoad
from tests.chaos.support import EngineTap
from tests.chaos.support import VersioningSource
from tests.chaos.support import adapter_of
from tests.chaos.support import eventually
from tests.chaos.support import is_generation
from tests.chaos.support import ledger_problems
from tests.chaos.support import now
from tests.chaos.support import nth_generation
from tests.chaos.support import served_before_loaded
from tests.chaos.support import session_tag
from tests.chaos.support import wire_problems
from tests.e2e.recording_proxy import Exchange
from tests.e2e.recording_proxy import TrafficLog
from tests.e2e.support import fleet_config

__all__ = [
    "BENCH_TIMES",
    "DEFAULT_TIMING",
    "FAST_TIMING",
    "LOAD_TIMEOUT",
    "HungTiming",
    "bench_line",
    "bench_run",
    "hung_engine",
]

#: The backend's per-engine load timeout: a publication that returns before it did not wait for
#: the hung engine's load (the issue saw publish() still waiting at 240 s of 300).
LOAD_TIMEOUT = 600.0
#: How long the scenario lets the trainer's publish() run before it calls the run broken: a
#: liveness guard far below the load timeout, never a measurement.
PUBLISH_GUARD = 180.0


@dataclass(frozen=True)
class HungTiming:
    """The product's timing settings for one run (seconds)."""

    request_timeout: float
    probe_interval: float
    probe_timeout: float
    eject_after: float


#: The documented defaults for the probes and ejection (what an operator runs), and a short
#: request timeout (the default, 600 s, would keep hung turns open for ten minutes).
DEFAULT_TIMING = HungTiming(request_timeout=10.0, probe_interval=2.0, probe_timeout=5.0,
                            eject_after=10.0)  # fmt: skip
#: Short enough for the test suite; the probe timeout stays above a busy engine's answer time.
FAST_TIMING = HungTiming(request_timeout=5.0, probe_interval=0.5, probe_timeout=2.0,
                         eject_after=3.0)  # fmt: skip


def _settings(taps: dict[str, EngineTap], fleet: EngineFleet, journal: Path,
              timing: HungTiming) -> AgenticLoRASettings:  # fmt: skip
    return load_settings(
        **fleet_config({name: tap.base_url for name, tap in taps.items()}, fleet.served_model_name),
        lora_name_prefix="chaos_lora",
        journal_path=journal,
        request_timeout=timing.request_timeout,
        probe_interval=timing.probe_interval,
        probe_timeout=timing.probe_timeout,
        eject_after=timing.eject_after,
    )


@contextlib.contextmanager
def _stoppable(fleet: EngineFleet, victim: str) -> Iterator[dict[str, bool]]:
    """SIGSTOP / SIGCONT of the victim's process group; whatever happens, it runs again after."""
    pgid = fleet.pid(victim)
    assert pgid is not None, f"{victim} is not running"
    state = {"stopped": False}
    try:
        yield state
    finally:
        if state["stopped"]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGCONT)


class _Membership:
    """The victim's membership changes as the registry applied them, on the scenario's clock and
    the traffic log's (a journaled verb's result is the engine's new state)."""

    def __init__(self, traffic: TrafficLog) -> None:
        self.traffic = traffic
        self.events: list[tuple[MemberState, float, int]] = []
        self.changed = asyncio.Event()

    def __call__(self, verb: str, result: Any) -> None:
        if verb in ("eject_engine", "activate_engine") and isinstance(result, MemberState):
            self.events.append((result, now(), self.traffic.mark(f"{verb} -> {result.value}")))
            self.changed.set()

    def first(self, state: MemberState, after: float = float("-inf")) -> tuple[float, int] | None:
        return next(((t, seq) for s, t, seq in self.events if s is state and t > after), None)

    async def wait(self, state: MemberState, after: float, what: str) -> tuple[float, int]:
        try:
            async with asyncio.timeout(PUBLISH_GUARD):
                while (found := self.first(state, after)) is None:
                    self.changed.clear()
                    await self.changed.wait()
        except TimeoutError:
            raise AssertionError(f"never happened: {what} ({self.events})") from None
        return found


async def hung_engine(
    fleet: EngineFleet,
    workdir: Path,
    rng: random.Random,
    *,
    name: str = "hung-engine",
    timing: HungTiming = FAST_TIMING,
) -> FaultReport:
    """Run the scenario (see the module docstring); what it measured and every problem."""
    report = FaultReport(fault="hung engine (SIGSTOP)", seed_name=name)
    victim = rng.choice(fleet.names)
    after = rng.randint(2, 8)
    report.choices = {"victim": victim, "after_generations": after, **timing.__dict__}
    tag = uuid.uuid4().hex[:6]
    a_id, b_id, c_id = f"A-{tag}", f"B-{tag}", f"C-{tag}"
    traffic = TrafficLog()
    snapshots = {x: AdapterSnapshot.from_peft_dir(fleet.fixture.adapter(x)) for x in "ABC"}
    membership = _Membership(traffic)
    hung: list[Exchange] = []
    async with taps_on(fleet, traffic) as taps:
        deployment = Deployment.from_settings(
            _settings(taps, fleet, workdir / "registry.sqlite", timing),
            backend_options={
                "store_root": str(workdir / "adapter-store"),
                "timeouts": AdminTimeouts(load=LOAD_TIMEOUT),
            },
        )
        feed = change_feed(deployment.registry)
        assert feed is not None
        feed.add_listener(membership)
        async with deployment:
            if not (await deployment.publish(a_id, snapshots["A"])).ok:
                raise AssertionError(f"the first publication of {a_id} failed")
            source = VersioningSource(deployment.versioning)
            load = AgentLoad(source, agents=AGENTS, prefix=f"h{tag}")
            load.start()
            with _stoppable(fleet, victim) as stoppable:
                try:
                    await nth_generation(traffic, after, engine=victim)
                    armed = traffic.mark("armed")
                    health_times: dict[str, float | None] = {}
                    watch = asyncio.create_task(
                        watch_health(deployment.versioning.health, victim, health_times)
                    )
                    pgid = fleet.pid(victim)
                    assert pgid is not None

                    def stop_on_arrival(e: Exchange) -> bool:
                        # Stopped synchronously as the tap receives the generation, before it
                        # forwards it: the turn is in flight on a stopped engine.
                        if (
                            e.engine == victim and e.seq_sent > armed and not e.done
                            and is_generation(e) and session_tag(e) is not None
                        ):  # fmt: skip
                            os.killpg(pgid, signal.SIGSTOP)
                            stoppable["stopped"] = True
                            return True
                        return False

                    first_hung = await traffic.wait_for(stop_on_arrival, what="a turn on victim")
                    stop_at = now()
                    stop_mark = traffic.mark(f"{victim} stopped")
                    # The trainer publishes while the engine is hung.
                    published = await asyncio.wait_for(
                        deployment.publish(b_id, snapshots["B"]), PUBLISH_GUARD
                    )
                    report.times["publish_s"] = round(now() - stop_at, 3)
                    ejected_at, _ = await membership.wait(MemberState.EJECTED, stop_at, "ejection")
                    report.times["ejected_s"] = round(ejected_at - stop_at, 3)
                    # The Sessions go on on the live engine while the victim stays hung.
                    await nth_generation(
                        traffic, 2 * AGENTS, since=traffic.mark("ejected"),
                        engine=next(n for n in fleet.names if n != victim),
                    )  # fmt: skip
                    # Every turn the victim holds ends (indeterminate, at request_timeout).
                    hung = [
                        e for e in traffic.exchanges
                        if e.engine == victim and is_generation(e) and not e.done
                    ]  # fmt: skip
                    await _attempts_ended(load, hung)
                    # Still hung, A's Sessions gone: C's reservation needs A's slot, whose reclaim
                    # cannot finish on the hung engine.
                    skipped = await _publish_needing_a_slot(
                        deployment, a_id, c_id, snapshots, report
                    )
                    cont_at = now()
                    os.killpg(pgid, signal.SIGCONT)
                    stoppable["stopped"] = False
                    cont_mark = traffic.mark(f"{victim} continued")
                    activated_at, activated_mark = await membership.wait(
                        MemberState.ACTIVE, cont_at, "rejoin"
                    )
                    report.times["rejoined_s"] = round(activated_at - cont_at, 3)
                    serving = await load.progress.wait_for(
                        lambda a: a.outcome is AttemptOutcome.OK and a.engine == victim
                        and a.started_at > activated_at,
                        what=f"{victim} serving again",
                    )  # fmt: skip
                    report.back_s = round(serving.started_at + serving.latency_s - cont_at, 3)
                    rejoined: RegistryStatus = await deployment.registry.status()
                    # Rejoined: the next publication unloads A there too and commits on both.
                    start = now()
                    again = await asyncio.wait_for(
                        deployment.publish(c_id, snapshots["C"]), PUBLISH_GUARD
                    )
                    report.times["publish_after_rejoin_s"] = round(now() - start, 3)
                    after_rejoin = await deployment.registry.status()
                finally:
                    await load.stop()
            watch.cancel()
            final = await settle(deployment.registry.status, what="registry after the load")
            report.problems += ledger_problems(final, [a_id, b_id, c_id])
            b_name = deployment.registry.peek_version(b_id).lora_name  # type: ignore[attr-defined]
        report.problems += wire_problems(taps, traffic)
    report.first_publication_s = report.times["publish_s"]
    report.requests, report.episodes = len(load.attempts), len(load.episodes)
    report.publications = {"published": 3, "skipped": 1}
    report.problems += [f"agent loop error: {e}" for e in load.errors]
    marked = health_times.get("marked_unhealthy_s")
    report.times["marked_unhealthy_s"] = None if marked is None else round(marked - stop_at, 3)
    report.problems += _publication_problems(published, victim)
    report.problems += _membership_problems(rejoined, victim, b_id)
    report.problems += _slot_problems(skipped, again, after_rejoin, a_id, c_id)
    report.problems += _rejoin_problems(traffic, victim, b_name, stop_mark, cont_mark,
                                        activated_mark)  # fmt: skip
    detected = min(t for t in (marked, ejected_at) if t is not None)
    report.failures = _failures(load, victim, stop_at, detected)
    report.times["failed_in_flight_at_stop"] = float(len(report.failures["in_flight"]))
    report.times["failed_started_after_stop"] = float(len(report.failures["sent_before_detection"]))
    report.problems += [f"request failed that the hang cannot explain: {f}"
                        for f in report.failures["unexplained"]]  # fmt: skip
    cut = [a for a in load.attempts if a.rid == first_hung.field("rid")]
    if not cut or cut[0].error_code != RequestIndeterminateError.code:
        report.problems.append(f"the turn in flight at the stop did not end indeterminate: {cut}")
    report.choices["hung_turns"] = len(hung)
    report.goals = {
        "publish() returns within probe detection + one load (under 30 s)": (
            report.times["publish_s"] is not None and report.times["publish_s"] < 30.0
        ),
        "a publication needing a slot while hung is SKIPPED, never waits for the unload": (
            skipped[0].outcome is PublicationOutcome.SKIPPED
        ),
        "no Session changed version": not any("adapters" in p for p in report.problems),
        "0 failed requests once the hung engine was out of routing": (
            not report.failures["unexplained"]
        ),
    }
    return report


async def _publish_needing_a_slot(
    deployment: Deployment,
    a_id: str,
    c_id: str,
    snapshots: dict[str, AdapterSnapshot],
    report: FaultReport,
) -> tuple[PublicationResult, VersionStatus]:
    """Once A's last Session is gone, publish C (both slots held: B, and A on its way out) and
    return its result with A's state right after."""

    async def a_unbound() -> bool:
        v = await deployment.registry.version(a_id)
        return v.session_refs == 0 and v.state in (VersionState.RETIRED, VersionState.RECLAIMING)

    await eventually(a_unbound, what=f"{a_id}'s last Session closed")
    start = now()
    result = await asyncio.wait_for(deployment.publish(c_id, snapshots["C"]), PUBLISH_GUARD)
    report.times["publish_needing_reclaim_s"] = round(now() - start, 3)
    return result, await deployment.registry.version(a_id)


def _slot_problems(
    skipped: tuple[PublicationResult, VersionStatus],
    again: PublicationResult,
    after: RegistryStatus,
    a_id: str,
    c_id: str,
) -> list[str]:
    """While the engine hung, C was SKIPPED for capacity (A's reclaim unconfirmed there: its
    slot held); once it rejoined, C committed, A was RECLAIMED and C is READY on every engine."""
    problems: list[str] = []
    result, a = skipped
    if result.outcome is not PublicationOutcome.SKIPPED or result.reason != CapacityError.code:
        problems.append(f"publication needing a slot while hung: {result}")
    if a.state is not VersionState.RECLAIMING:
        problems.append(f"{a_id} is {a.state.value} while the engine hung, not RECLAIMING")
    versions = {v.version_id: v for v in after.versions}
    if again.outcome is not PublicationOutcome.PUBLISHED:
        problems.append(f"publication after the rejoin did not commit: {again}")
    elif versions[a_id].state is not VersionState.RECLAIMED:
        problems.append(f"{a_id} not RECLAIMED after the rejoin: {versions[a_id]}")
    elif set(versions[c_id].ready_engines) != {e.engine for e in after.engines}:
        problems.append(f"{c_id} not READY on every engine: {versions[c_id]}")
    return problems


async def _attempts_ended(load: AgentLoad, hung: list[Exchange]) -> None:
    """Wait until every Session request hung on the victim has ended for its agent."""
    rids = {e.field("rid") for e in hung if session_tag(e) is not None}
    for rid in rids:
        await load.progress.wait_for(lambda a, rid=rid: a.rid == rid, what=f"turn {rid} ended")


def _publication_problems(result: PublicationResult, victim: str) -> list[str]:
    reports = {r.engine: r for r in result.engines}
    problems: list[str] = []
    if result.outcome is not PublicationOutcome.PUBLISHED or result.commit is None:
        problems.append(f"the publication while {victim} hung did not commit: {result}")
    if reports.get(victim) is None or reports[victim].error_code != ENGINE_EJECTED:
        problems.append(f"the hung engine is not reported {ENGINE_EJECTED}: {result.engines}")
    for engine, r in reports.items():
        if engine != victim and (not r.ready or r.error_code is not None):
            problems.append(f"live member {engine} not READY in the publication: {r}")
    return problems


def _membership_problems(status: RegistryStatus, victim: str, default: str) -> list[str]:
    problems: list[str] = []
    members = {e.engine: e.membership for e in status.engines}
    if any(m is not MemberState.ACTIVE for m in members.values()):
        problems.append(f"not every engine ACTIVE after the rejoin: {members}")
    versions = {v.version_id: v for v in status.versions}
    if status.default_version != default:
        problems.append(f"the default is {status.default_version}, not {default}")
    elif victim not in versions[default].ready_engines:
        problems.append(f"{victim} not READY for the default after the rejoin: {versions[default]}")
    return problems


def _rejoin_problems(
    traffic: TrafficLog, victim: str, b_name: str, stop: int, cont: int, activated: int
) -> list[str]:
    """The victim was activated only after B (published while it hung) was loaded onto it, and
    it received no generation for B before that load was answered."""
    exchanges = list(traffic.exchanges)
    loaded = [
        e for e in exchanges
        if e.engine == victim and e.path == "/load_lora_adapter" and e.lora == b_name
        and e.status == 200 and e.seq_sent > cont and e.seq_done is not None
    ]  # fmt: skip
    problems: list[str] = []
    if not loaded or min(e.seq_done or 0 for e in loaded) > activated:
        problems.append(f"{victim} rejoined before {b_name} was loaded onto it: {loaded}")
    early = [g for g in served_before_loaded(exchanges, victim, stop) if adapter_of(g) == b_name]
    problems += [f"{victim} got a generation for {b_name} before it held it: {g!r}" for g in early]
    return problems


def _failures(
    load: AgentLoad, victim: str, stop_at: float, detected: float
) -> dict[str, list[str]]:
    """Failed attempts by what explains them: ``in_flight`` (on the victim, started
    before the stop), ``sent_before_detection`` (on the victim, started after the stop and before
    the product took it out of routing), both indeterminate; ``unexplained``: everything else."""
    out: dict[str, list[str]] = {
        "before": [], "in_flight": [], "sent_before_detection": [], "unexplained": [],
    }  # fmt: skip
    for a in load.failed():
        what = (f"{a.session_id} {a.outcome.value} {a.error_code} on {a.engine} at "
                f"{a.started_at - stop_at:+.2f} s, {a.latency_s:.1f} s")  # fmt: skip
        hung = a.engine == victim and a.outcome is AttemptOutcome.INDETERMINATE
        if a.started_at + a.latency_s < stop_at:
            out["before"].append(what)
        elif hung and a.started_at < stop_at:
            out["in_flight"].append(what)
        elif hung and a.started_at < detected:
            out["sent_before_detection"].append(what)
        else:
            out["unexplained"].append(what)
    return out


# --- bench/chaos.py ---------------------------------------------------------------------------

#: The times this fault adds to the benchmark's summary.
BENCH_TIMES = ("publish_s", "ejected_s", "rejoined_s", "publish_needing_reclaim_s",
               "publish_after_rejoin_s", "failed_in_flight_at_stop",
               "failed_started_after_stop")  # fmt: skip


async def bench_run(
    fleet: EngineFleet, workdir: Path, rng: random.Random, *, name: str
) -> dict[str, Any]:
    """One benchmark run at the documented probe and ejection defaults, as a run record."""
    report = await hung_engine(fleet, workdir, rng, name=name, timing=DEFAULT_TIMING)
    out = report.as_dict()
    out.update({k: report.times.get(k) for k in BENCH_TIMES}, bench_times=list(BENCH_TIMES))
    # Every failed request that started after the stop, and those the hang cannot explain.
    late, unexplained = (len(report.failures[k]) for k in ("sent_before_detection", "unexplained"))
    out["times"].update(failed_after_fault=float(late + unexplained),
                        failed_after_detection=float(unexplained))  # fmt: skip
    return out


def bench_line(s: dict[str, Any], cell: Any) -> str:
    """The benchmark's line for this fault, from its summary (``cell`` formats a time's stats)."""
    t = DEFAULT_TIMING
    return (
        f"hung engine (SIGSTOP; probe every {t.probe_interval:.0f} s, timeout "
        f"{t.probe_timeout:.0f} s, eject after {t.eject_after:.0f} s, request timeout "
        f"{t.request_timeout:.0f} s, load timeout {LOAD_TIMEOUT:.0f} s): publish() returned "
        f"{cell(s['publish_s'])} after the stop (goal under 30 s), ejected after "
        f"{cell(s['ejected_s'])}; after SIGCONT rejoined in {cell(s['rejoined_s'])} and served "
        f"in {cell(s['back_s'])}; a publication needing a slot while it hung was SKIPPED in "
        f"{cell(s['publish_needing_reclaim_s'])}, and committed {cell(s['publish_after_rejoin_s'])}"
        f" after the rejoin; failed requests: in flight at the stop "
        f"{cell(s['failed_in_flight_at_stop'])}, sent after it before detection "
        f"{cell(s['failed_started_after_stop'])}, after detection {s['failed_after_detection']}"
    )
