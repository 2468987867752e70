"""One scenario per fault kind, shared by the chaos tests (verdicts) and ``bench/chaos.py`` (times).

Each scenario builds its topology on an already running :class:`EngineFleet`, runs agent load and
publications every few seconds, injects its fault at a seeded point, waits (bounded) for the
recovery events, stops the load, lets the registry settle, and returns a :class:`FaultReport`:
what was measured and every invariant that did not hold (``problems``). The scenario never
asserts itself, so the benchmark can repeat it and report; the tests assert ``problems == []``.

Topologies (see the chaos test modules' docstrings for why):

* in-process (:func:`engine_restart`): a :class:`~agentic_lora.assembly.deployment.Deployment` in this
  process (journaled LocalRegistry, Sessions, publisher, reclaimer, repairer) and the agents on
  its Sessions; the fault is one engine killed -9 and restarted;
* gateway (:func:`serve_killed`): ``agentic-lora serve`` as a child process (registry with its
  journal, publisher, reclaimer, gateway), agents as HTTP clients, publications through the
  admin route; the fault is that process killed -9 and started again on the same journal and
  port, either at a point in the agents' traffic (the gateway fault) or inside a publication
  (the registry host fault).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import re
import signal
import uuid
from collections.abc import AsyncIterator
from collections.abc import Awaitable
from collections.abc import Callable
from dataclasses import asdict
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any

from agentic_lora_agent import AttemptOutcome
from agentic_lora_agent import AttemptRecord
from agentic_lora_harness.engines import EngineFleet

from agentic_lora.adapters.snapshot import AdapterSnapshot
from agentic_lora.assembly.deployment import Deployment
from agentic_lora.config import AgenticLoRASettings
from agentic_lora.config import load_settings
from agentic_lora.registry.api import change_feed
from agentic_lora.registry.types import RegistryStatus
from agentic_lora.registry.types import VersionState
from agentic_lora.registry.types import VersionStatus
from tests.chaos.support import AgentLoad
from tests.chaos.support import EngineTap
from tests.chaos.support import GatewaySource
from tests.chaos.support import PublicationLoop
from tests.chaos.support import ServeProcess
from tests.chaos.support import VersioningSource
from tests.chaos.support import eventually
from tests.chaos.support import is_generation
from tests.chaos.support import ledger_problems
from tests.chaos.support import load_config
from tests.chaos.support import now
from tests.chaos.support import nth_generation
from tests.chaos.support import settled
from tests.chaos.support import status_from_json
from tests.chaos.support import wire_problems
from tests.e2e.recording_proxy import Exchange
from tests.e2e.recording_proxy import TrafficLog
from tests.e2e.support import fleet_config

__all__ = [
    "LEASE_TTL",
    "PUBLICATION_SLACK",
    "FaultReport",
    "engine_restart",
    "reclaim_events",
    "serve_killed",
    "tapped_deployment",
    "taps_on",
]

logger = logging.getLogger(__name__)

#: The owner-lease TTL the scenarios configure (short, so a dead owner's refs come back quickly).
LEASE_TTL = 5.0
#: The issue's bound: publication progresses again within lease TTL + this many seconds.
PUBLICATION_SLACK = 30.0
#: Agents per scenario (the issue asks for 8 or more concurrent Sessions).
AGENTS = 8
#: Agents a gateway scenario parks across the restart (see AgentLoad.hold).
HELD_AGENTS = AGENTS // 2


@dataclass
class FaultReport:
    """What one fault did, on the scenario's clock (seconds from the fault unless named)."""

    fault: str
    seed_name: str
    choices: dict[str, Any] = field(default_factory=dict)
    #: Seconds the faulted part took to come back (engine healthy, serve serving), from the fault.
    back_s: float | None = None
    #: From the fault to the first publication that committed after it.
    first_publication_s: float | None = None
    #: From the fault to the first successful generation of a Session the fault affected.
    first_affected_generation_s: float | None = None
    #: Extra recovery times particular to the fault kind.
    times: dict[str, float | None] = field(default_factory=dict)
    requests: int = 0
    episodes: int = 0
    publications: dict[str, int] = field(default_factory=dict)
    #: Attempts that failed, by outcome and code, split at the fault.
    failures: dict[str, list[str]] = field(default_factory=dict)
    #: Goals of the issue: name -> held.
    goals: dict[str, bool] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    #: Registry samples over the run (engine fault only), for a post-mortem.
    ledger: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def write(self, path: Path) -> Path:
        """The whole report as JSON at ``path`` (kept with the test's files for a post-mortem)."""
        path.write_text(json.dumps(self.as_dict(), indent=2, default=str) + "\n")
        return path

    def summary(self) -> str:
        """A few lines for the test log: choices, times, goals, problems."""
        lines = [
            f"{self.fault} [{self.seed_name}] choices {self.choices}",
            f"  back after {self.back_s} s; first publication {self.first_publication_s} s, "
            f"first affected generation {self.first_affected_generation_s} s; {self.times}",
            f"  {self.requests} requests, {self.episodes} episodes, publications "
            f"{self.publications}; failed: "
            + ", ".join(f"{k} {len(v)}" for k, v in self.failures.items()),
        ]
        lines += [
            f"  failed ({when}): {line}"
            for when, found in self.failures.items()
            if when != "before"
            for line in found[:10]
        ]
        lines += [f"  {'HOLDS ' if ok else 'MISSES'} {goal}" for goal, ok in self.goals.items()]
        lines += [f"  PROBLEM {p}" for p in self.problems]
        return "\n".join(lines)


@contextlib.asynccontextmanager
async def taps_on(fleet: EngineFleet, traffic: TrafficLog) -> AsyncIterator[dict[str, EngineTap]]:
    """One :class:`EngineTap` per engine of ``fleet``, all recording on ``traffic``."""
    async with contextlib.AsyncExitStack() as stack:
        taps = {
            name: await stack.enter_async_context(EngineTap(name, url, traffic))
            for name, url in fleet.engines
        }
        yield taps


def _failures(load: AgentLoad, fault_at: float) -> dict[str, list[str]]:
    """Failed attempts: ended before the fault, started before it and ended after (cut by it),
    started after it. Each line names the Session, outcome, code, engine and start time (seconds
    from the fault)."""
    out: dict[str, list[str]] = {"before": [], "in_flight": [], "after": []}
    for a in load.failed():
        end = a.started_at + a.latency_s
        what = (
            f"{a.session_id} {a.outcome.value} {a.error_code} on {a.engine} "
            f"at {a.started_at - fault_at:+.2f} s"
        )
        if end < fault_at:
            out["before"].append(what)
        elif a.started_at < fault_at:
            out["in_flight"].append(what)
        else:
            out["after"].append(what)
    return out


def _slow(load: AgentLoad, fault_at: float, over: float = 10.0) -> list[str]:
    """Attempts that took longer than ``over`` seconds (for a post-mortem of a slow recovery)."""
    return [
        f"{a.session_id} {a.outcome.value} {a.error_code} on {a.engine} at "
        f"{a.started_at - fault_at:+.2f} s took {a.latency_s:.1f} s ({a.lora_name})"
        for a in load.attempts
        if a.latency_s > over
    ]


def _since(t: float | None, origin: float) -> float | None:
    return None if t is None else round(t - origin, 3)


async def _settle(status: Any, *, what: str) -> RegistryStatus:
    """Wait (bounded) until the registry has nothing left in flight (see support.settled)."""

    async def probe() -> RegistryStatus | None:
        s: RegistryStatus = await status()
        return s if settled(s) else None

    try:
        result: RegistryStatus = await eventually(probe, what=what)
    except AssertionError:
        final: RegistryStatus = await status()
        raise AssertionError(
            f"{what}: never settled; versions "
            + ", ".join(f"{v.version_id}={v.state.value}/{v.session_refs}" for v in final.versions)
        ) from None
    return result


# --- the engine fault ---------------------------------------------------------------------------


def _in_process_settings(
    taps: dict[str, EngineTap], fleet: EngineFleet, journal: Path
) -> AgenticLoRASettings:
    return load_settings(
        **fleet_config({name: tap.base_url for name, tap in taps.items()}, fleet.served_model_name),
        lora_name_prefix="chaos_lora",
        journal_path=journal,
        request_timeout=120.0,
    )


def tapped_deployment(taps: dict[str, EngineTap], fleet: EngineFleet, workdir: Path) -> Deployment:
    """A Deployment of ``fleet`` reached through its ``taps``, in this process: its journal at
    ``workdir/registry.sqlite``, the HTTP push store under ``workdir/adapter-store``."""
    settings = _in_process_settings(taps, fleet, workdir / "registry.sqlite")
    return Deployment.from_settings(
        settings, backend_options={"store_root": str(workdir / "adapter-store")}
    )


def reclaim_events(
    deployment: Deployment, also: Callable[[str, Any], None] | None = None
) -> dict[str, asyncio.Event]:
    """Per version id, an event set once the registry confirmed it RECLAIMED (read from the
    deployment's change feed; ``setdefault`` a version's event to wait for it). ``also`` is
    told every change first."""
    reclaimed: dict[str, asyncio.Event] = {}

    def on_change(verb: str, result: Any) -> None:
        if also is not None:
            also(verb, result)
        if (
            verb == "confirm_reclaim"
            and isinstance(result, VersionStatus)
            and result.state is VersionState.RECLAIMED
        ):
            reclaimed.setdefault(result.version_id, asyncio.Event()).set()

    feed = change_feed(deployment.registry)
    assert feed is not None
    feed.add_listener(on_change)
    return reclaimed


async def engine_restart(
    fleet: EngineFleet, workdir: Path, rng: random.Random, *, name: str = "engine"
) -> FaultReport:
    """Kill -9 one engine under load, restart it, and check the fleet recovered.

    Random choices (from ``rng``): the victim engine, and after how many of its answered
    generations (counted at its tap) it dies. The fault's clock starts when the engine is dead
    (its tap stopped accepting just before the kill, its process group is gone).

    Affected Sessions are those the router places on the victim (its own choice with every
    engine healthy), including ones opened after the fault. A request that started before the
    engine was dead and ended on it indeterminate or refused was cut by the kill; every request
    that started after it must succeed: each version is held by the surviving engine.
    """
    report = FaultReport(fault="engine restart", seed_name=name)
    victim = rng.choice(fleet.names)
    after = rng.randint(3, 20)
    report.choices = {"victim": victim, "after_generations": after}
    tag = uuid.uuid4().hex[:6]
    traffic = TrafficLog()
    snapshots = {x: AdapterSnapshot.from_peft_dir(fleet.fixture.adapter(x)) for x in "ABC"}
    async with taps_on(fleet, traffic) as taps:
        deployment = tapped_deployment(taps, fleet, workdir)
        async with deployment:

            async def publish(version_id: str, letter: str) -> str:
                result = await deployment.publish(version_id, snapshots[letter])
                return result.outcome.value

            pubs = PublicationLoop(publish, tag=tag)
            if not (await pubs.publish_once()).ok:
                raise AssertionError(f"the first publication failed: {pubs.records[-1]}")
            source = VersioningSource(deployment.versioning)
            load = AgentLoad(source, agents=AGENTS, prefix=f"s{tag}")
            load.start()
            pubs.start()
            try:
                start = traffic.mark("load started")
                await nth_generation(traffic, after, since=start, engine=victim)
                health = deployment.versioning.health
                watch = asyncio.create_task(_watch_health(health, victim, report.times))
                sampler = asyncio.create_task(
                    _sample_ledger(deployment.registry.status, report.ledger)
                )
                # The fault: the engine stops serving (its tap refuses and drops connections, as
                # the kernel does for a killed process), then its process group is killed -9.
                fault_at = now()
                down = await taps[victim].go_down()
                await asyncio.to_thread(fleet.kill, victim)
                dead_at = now()
                report.times["kill_s"] = round(dead_at - fault_at, 3)
                report.times["fault_at"] = fault_at
                report.choices["in_flight_at_kill"] = sum(
                    1
                    for e in traffic.exchanges
                    if e.engine == victim and is_generation(e) and e.seq_sent < down
                    and (e.seq_done is None or e.seq_done > down)
                )  # fmt: skip
                await fleet.arestart(victim)
                up = await taps[victim].come_up()
                back_at = now()
                report.back_s = round(back_at - fault_at, 3)
                report.times["engine_start_s"] = fleet.startup_seconds(victim)
                published = await pubs.wait_success_after(
                    fault_at, what="a publication after the engine came back"
                )
                report.first_publication_s = _since(published.end, fault_at)
                # The victim serves generations again (its versions were loaded onto it again).
                again = await load.progress.wait_for(
                    lambda a: (
                        a.outcome.value == "ok" and a.engine == victim and a.started_at > back_at
                    ),
                    what=f"{victim} serving a generation again",
                )
                report.times["victim_serves_again_s"] = _since(
                    again.started_at + again.latency_s, fault_at
                )

                def affected(session_id: str) -> bool:
                    return source.placed_on(session_id, victim)

                first = await load.wait_ok_after(
                    fault_at, affected, what="a generation of a Session placed on the victim"
                )
                report.first_affected_generation_s = _since(
                    first.started_at + first.latency_s, fault_at
                )
                # Some traffic after the recovery, so what comes after it is checked too.
                await nth_generation(traffic, 2 * AGENTS, since=traffic.mark("recovered"))
            finally:
                await pubs.stop()
                await load.stop()
            watch.cancel()
            sampler.cancel()
            origin = report.times.pop("fault_at") or fault_at
            for sample in report.ledger:
                sample["t"] = round(sample["t"] - origin, 2)
            for key in ("marked_unhealthy_s", "marked_healthy_s"):
                if report.times.get(key) is not None:
                    report.times[key] = round(float(report.times[key] or 0) - origin, 3)
            final = await _settle(deployment.registry.status, what="registry after the load")
            report.problems += ledger_problems(final, pubs.committed)
        report.problems += wire_problems(taps, traffic)
        for tap in taps.values():
            for exchange, reason in tap.upstream_failures:
                if tap.engine != victim or exchange.seq_sent > up:
                    report.problems.append(f"an engine was unreachable while up: {reason}")
    marked = report.times.get("marked_unhealthy_s")
    marked_at = fault_at + marked if marked is not None else float("inf")
    report.failures = _engine_failures(load, victim, fault_at, dead_at, marked_at)
    report.failures["slow"] = _slow(load, fault_at)
    report.requests = len(load.attempts)
    report.episodes = len(load.episodes)
    report.publications = _publication_counts(pubs)
    report.problems += [f"agent loop error: {e}" for e in load.errors]
    if marked is None:
        report.problems.append(f"{victim} was never taken out of routing after it died")
    if report.failures["after"]:
        report.problems.append(
            f"{len(report.failures['after'])} requests failed that the kill cannot explain "
            f"(on the surviving engine, or on {victim} after it was taken out of routing, or "
            f"indeterminate though it was dead when they started): {report.failures['after'][:8]}"
        )
    # Every request that started once the engine had stopped serving. Those sent to it before
    # the product noticed (a fraction of a second) fail as the kill left them: refused, or
    # indeterminate if in flight; a generation is sent exactly once, so nothing moves them to
    # the other engine behind the caller's back. From detection on, none may fail: the other
    # engine holds every version.
    strict = [a for a in load.failed() if a.started_at >= fault_at]
    report.times["failed_after_fault"] = float(len(strict))
    after_detection = [a for a in strict if a.started_at >= marked_at]
    report.times["failed_after_detection"] = float(len(after_detection))
    slack = LEASE_TTL + PUBLICATION_SLACK
    within = (
        report.first_publication_s is not None
        and report.first_publication_s - report.back_s <= slack
    )
    if not within:
        report.problems.append(
            f"no publication within {slack:.0f} s of the engine's return "
            f"(first after {report.first_publication_s} s; back after {report.back_s} s)"
        )
    report.goals = {
        f"publication within TTL + {PUBLICATION_SLACK:.0f} s of the engine's return": within,
        "affected Sessions served within engine start + 5 s": (
            report.first_affected_generation_s is not None
            and report.first_affected_generation_s <= report.back_s + 5.0
        ),
        "0 failed requests once the dead engine was out of routing": not after_detection,
    }
    return report


def _engine_failures(
    load: AgentLoad, victim: str, down_at: float, dead_at: float, marked_at: float
) -> dict[str, list[str]]:
    """The engine fault's failed attempts, by what explains them.

    * ``before``: ended before the engine stopped serving (nothing to do with the fault);
    * ``cut_by_kill``: on the victim, started before it was dead (in flight, or sent while it
      was dying): refused or indeterminate, as the kill left them;
    * ``refused_before_detection``: on the victim, started after it was dead but before the
      product took it out of routing, and refused (nothing was sent);
    * ``after``: everything else; none may exist (the other engine holds every version).
    """
    out: dict[str, list[str]] = {
        "before": [],
        "cut_by_kill": [],
        "refused_before_detection": [],
        "after": [],
    }
    for a in load.failed():
        what = (
            f"{a.session_id} {a.outcome.value} {a.error_code} on {a.engine} "
            f"at {a.started_at - down_at:+.2f} s"
        )
        if a.started_at + a.latency_s < down_at:
            out["before"].append(what)
        elif a.engine == victim and a.started_at < dead_at:
            out["cut_by_kill"].append(what)
        elif (
            a.engine == victim and a.started_at < marked_at and a.outcome is AttemptOutcome.REFUSED
        ):
            out["refused_before_detection"].append(what)
        else:
            out["after"].append(what)
    return out


async def _sample_ledger(status: Any, out: list[dict[str, Any]]) -> None:
    """Every second, the registry's versions (state, Session refs, holders), for a post-mortem
    of a slow recovery (measurement only)."""
    while True:
        s: RegistryStatus = await status()
        out.append(
            {
                "t": now(),
                "default": s.default_version,
                "slots": s.slots_in_use,
                "versions": {
                    v.version_id: f"{v.state.value}/{v.session_refs}/{','.join(v.ready_engines)}"
                    for v in s.versions
                    if v.state.holds_slot
                },
            }
        )
        await asyncio.sleep(1.0)


async def _watch_health(health: Any, engine: str, times: dict[str, float | None]) -> None:
    """Record when ``engine`` stops and starts being routed to (measurement only: it samples an
    in-memory flag every 50 ms and decides nothing)."""
    # EngineHealth has no event to await: only its flag can be read.
    while health.is_healthy(engine):  # noqa: ASYNC110
        await asyncio.sleep(0.05)
    times["marked_unhealthy_s"] = now()
    while not health.is_healthy(engine):  # noqa: ASYNC110
        await asyncio.sleep(0.05)
    times["marked_healthy_s"] = now()


def _publication_counts(pubs: PublicationLoop) -> dict[str, int]:
    counts: dict[str, int] = {}
    for p in pubs.records:
        key = p.outcome or f"error {p.error}"
        counts[key] = counts.get(key, 0) + 1
    return counts


# --- the gateway process and the registry host --------------------------------------------------


def _serve_settings() -> dict[str, Any]:
    from agentic_lora.config import AgenticLoRASettings

    fields = AgenticLoRASettings.model_fields
    wanted: dict[str, Any] = {"lease_ttl": LEASE_TTL, "gateway_id": "chaos-gateway"}
    return {k: v for k, v in wanted.items() if k in fields}


async def serve_killed(
    fleet: EngineFleet,
    workdir: Path,
    rng: random.Random,
    *,
    during: str,
    name: str,
) -> FaultReport:
    """Kill -9 the ``agentic-lora serve`` process and start it again on its journal and port.

    ``during="traffic"`` (the gateway fault): it dies after a seeded number of answered agent
    generations. ``during="publication"`` (the registry host fault): it dies inside a publication,
    at a seeded point: right after the first adapter load of that publication reached an engine,
    after the first engine answered it, or after the last one did (READY everywhere, commit next).
    """
    report = FaultReport(
        fault="gateway process" if during == "traffic" else "registry host", seed_name=name
    )
    tag = uuid.uuid4().hex[:6]
    traffic = TrafficLog()
    point = rng.choice(["load sent", "first load answered", "every load answered"])
    after = rng.randint(5, 30)
    report.choices = {"after_generations": after} if during == "traffic" else {"point": point}
    async with taps_on(fleet, traffic) as taps:
        serve = ServeProcess(
            workdir=workdir,
            engines={n: t.base_url for n, t in taps.items()},
            base_model=fleet.served_model_name,
            settings=_serve_settings(),
        )
        report.times["serve_start_s"] = round(await serve.start(), 3)
        admin = serve.admin()
        source = GatewaySource(serve.url)
        try:

            async def publish(version_id: str, letter: str) -> str:
                result = await admin.publish(str(fleet.fixture.adapter(letter)), version_id)
                return str(result["outcome"])

            async def status() -> RegistryStatus:
                return status_from_json((await admin.status())["registry"])

            pubs = PublicationLoop(publish, tag=tag)
            if not (await pubs.publish_once()).ok:
                raise AssertionError(f"the first publication failed: {pubs.records[-1]}")
            # Enough retries (0.25 s apart while the gateway is unreachable) to span a restart.
            load = AgentLoad(
                source, agents=AGENTS, prefix=f"g{tag}", config=load_config(max_retries=240)
            )
            load.start()
            pubs.start()
            try:
                start = traffic.mark("load started")
                if during == "traffic":
                    await nth_generation(traffic, after, since=start)
                # Half the agents park between two turns of their bound Sessions; they go on only
                # after serve is back *and* a new default is committed, so a gateway that forgot
                # their binding would bind them again to that new default (a second version).
                # Publications pause while they park, so all park on the default of now (parked
                # on an older, retired version they would hold its slot and starve publication).
                await pubs.pause()
                parked = await load.hold(range(HELD_AGENTS), on_version=pubs.committed[-1])
                pubs.resume()
                if during == "publication":
                    report.choices["version"] = await _inside_publication(
                        traffic, pubs, point, engines=len(taps)
                    )
                affected = set(load.live) - parked
                fault_at = now()
                await serve.kill()
                dead_at = now()
                restarted = await serve.start()
                back_at = now()
                report.back_s = round(back_at - fault_at, 3)
                report.times["serve_restart_s"] = round(restarted, 3)
                report.choices["affected_sessions"] = len(affected)
                report.choices["parked_sessions"] = len(parked)
                published = await pubs.wait_success_after(
                    fault_at, what="a publication after serve came back"
                )
                report.first_publication_s = _since(published.end, fault_at)
                released = now()
                load.release()
                # Every Session's requests go through the gateway: all are affected.
                first = await load.wait_ok_after(fault_at, what="a generation after the restart")
                report.first_affected_generation_s = _since(
                    first.started_at + first.latency_s, fault_at
                )
                mine = load.first_ok_after(fault_at, lambda s: s in affected)
                report.times["first_generation_of_open_session_s"] = _since(
                    mine.started_at + mine.latency_s if mine else None, fault_at
                )
                # Every parked Session sends its next request (an answer or a typed refusal).
                waiting = set(parked)

                def went_on_once(a: AttemptRecord) -> bool:
                    if a.started_at > released:
                        waiting.discard(a.session_id)
                    return not waiting

                await load.progress.wait_for(
                    went_on_once, what=f"parked Sessions {waiting} went on"
                )
                await nth_generation(traffic, 2 * AGENTS, since=traffic.mark("recovered"))
            finally:
                load.release()
                await pubs.stop()
                await load.stop()
            went_on = {
                a.session_id
                for a in load.attempts
                if a.session_id in parked and a.started_at > released and a.outcome.value == "ok"
            }
            report.choices["parked_sessions_served_again"] = len(went_on)
            if not went_on:
                # The hazard this scenario exists for was not exercised: no bound Session was
                # served across the restart and a new default.
                report.problems.append(
                    f"no parked Session was served after the restart: {_parked_outcomes(load, parked, released)}"
                )
            final = await _settle(status, what="registry after the load")
            report.problems += ledger_problems(final, pubs.committed)
        finally:
            await source.aclose()
            await admin.aclose()
            await serve.stop()
        report.problems += wire_problems(taps, traffic)
        for tap in taps.values():
            report.problems += [
                f"an engine was unreachable: {reason}" for _, reason in tap.upstream_failures
            ]
    report.failures = _failures(load, fault_at)
    report.requests = len(load.attempts)
    report.episodes = len(load.episodes)
    report.publications = _publication_counts(pubs)
    report.problems += [f"agent loop error: {e}" for e in load.errors]
    # A request that started while serve was being killed may have reached it: only those that
    # started once it was dead must be typed refusals.
    untyped = [
        f"{a.session_id} {a.outcome.value} {a.error_code}"
        for a in load.failed(started_after=dead_at)
        if not _typed_refusal(a.outcome.value, a.error_code)
    ]
    if untyped:
        report.problems.append(
            f"{len(untyped)} requests that started after serve was dead failed otherwise than "
            f"by a typed refusal (nothing sent): {untyped[:8]}"
        )
    slack = LEASE_TTL + PUBLICATION_SLACK
    report.goals = {
        f"publication within TTL + {PUBLICATION_SLACK:.0f} s of the restart": (
            report.first_publication_s is not None
            and report.first_publication_s - report.back_s <= slack
        ),
    }
    if not report.goals[f"publication within TTL + {PUBLICATION_SLACK:.0f} s of the restart"]:
        report.problems.append(
            f"no publication within {slack:.0f} s of the restart "
            f"(first after {report.first_publication_s} s; back after {report.back_s} s)"
        )
    return report


def _parked_outcomes(load: AgentLoad, parked: set[str], since: float) -> list[str]:
    return [
        f"{a.session_id} {a.outcome.value} {a.error_code}"
        for a in load.attempts
        if a.session_id in parked and a.started_at > since
    ]


async def _inside_publication(
    traffic: TrafficLog, pubs: PublicationLoop, point: str, *, engines: int
) -> str:
    """Return at ``point`` inside the first publication from now on that loads anything (one
    refused for capacity loads nothing). Returns its version id.

    With Sessions parked on the default, it is also the only one that can: once it commits, the
    parked Sessions' version is retired and holds the second slot until they go on."""
    first_n = pubs.next_index
    pattern = re.compile(rf"-([A-Z])(\d+)-{re.escape(pubs.tag)}-")

    def version(e: Exchange) -> str | None:
        if e.path != "/load_lora_adapter":
            return None
        m = pattern.search(e.lora or "")
        return f"{m[1]}{m[2]}-{pubs.tag}" if m and int(m[2]) >= first_n else None

    sent = await traffic.wait_for(
        lambda e: version(e) is not None, what=f"a load of publication #{first_n} or later"
    )
    target = version(sent)
    assert target is not None
    if point == "load sent":
        return target
    need = 1 if point == "first load answered" else engines
    answered: set[int] = set()

    def counted(e: Exchange) -> bool:
        if version(e) == target and e.done and e.status == 200:
            answered.add(id(e))
        return len(answered) >= need

    await traffic.wait_for(counted, what=f"{need} answered loads of {target}")
    return target


# --- rollout workers and the registry actor (Ray) -----------------------------------------------

#: The namespace of the chaos suite's registry actors on the Ray cluster.
RAY_NAMESPACE = "agentic-lora-chaos"
#: A lease TTL long enough that only an owner restart can end it within a scenario.
LONG_LEASE_TTL = 120.0
WORKERS = 2


def _lease_gone(status: RegistryStatus, owner: str, incarnation: str | None = None) -> bool:
    return not any(
        lease.owner == owner and (incarnation is None or lease.incarnation == incarnation)
        for lease in status.leases
    )


async def ray_topology(
    fleet: EngineFleet, workdir: Path, rng: random.Random, *, fault: str, name: str
) -> FaultReport:
    """Rollout workers in their own processes, one registry actor, this process publishing.

    Call with Ray initialised (``ray.init``) in this process. ``fault="worker"``: a worker is
    killed -9 at a seeded point and left dead until its lease has expired (refs released by the
    TTL), then restarted under its owner id, killed again while it holds Sessions under a lease
    too long to expire, and restarted at once (its new incarnation must release the old one's
    refs without waiting for that TTL). ``fault="actor"``: the registry actor's process is killed
    -9 at a seeded point; Ray restarts it from its journal.
    """
    import ray
    from agentic_lora_http import HttpPushBackend

    from agentic_lora.registry.ray_actor import connect
    from agentic_lora.session import Versioning
    from tests.chaos.support import WorkerProcess

    report = FaultReport(
        fault="rollout worker" if fault == "worker" else "registry actor", seed_name=name
    )
    tag = uuid.uuid4().hex[:6]
    victim_index = rng.randrange(WORKERS)
    after = rng.randint(3, 15)
    report.choices = {"after_generations": after}
    if fault == "worker":
        report.choices["victim"] = f"w{victim_index}"
    traffic = TrafficLog()
    snapshots = {x: AdapterSnapshot.from_peft_dir(fleet.fixture.adapter(x)) for x in "ABC"}
    journal = workdir / "registry.sqlite"
    registry_name = f"chaos-registry-{tag}"
    async with taps_on(fleet, traffic) as taps:
        registry = connect(
            engines=fleet.names,
            capacity=2,
            prefix="chaos_lora",
            journal_path=journal,
            name=registry_name,
            namespace=RAY_NAMESPACE,
        )
        settings = load_settings(
            enable_versioned_lora_publication=True,
            engines=[f"{n}={t.base_url}" for n, t in taps.items()],
            capacity=2,
            base_model_name=fleet.served_model_name,
            lora_name_prefix="chaos_lora",
            owner_id=f"publisher-{tag}",
            lease_ttl=LEASE_TTL,
            request_timeout=120.0,
        )
        versioning = Versioning.from_settings(settings, registry=registry)
        backend = HttpPushBackend(workdir / "adapter-store")
        deployment = Deployment(settings=settings, versioning=versioning, backend=backend)
        worker_config = {
            "ray_address": ray.get_runtime_context().gcs_address,
            "namespace": RAY_NAMESPACE,
            "registry_name": registry_name,
            "journal": str(journal),
            "engines": {n: t.base_url for n, t in taps.items()},
            "base_model": fleet.served_model_name,
            "prefix": "chaos_lora",
            "agents": AGENTS // WORKERS,
        }
        workers = [WorkerProcess(workdir, f"w{i}-{tag}", worker_config) for i in range(WORKERS)]
        victim = workers[victim_index]
        fault_at = now()
        try:
            async with deployment:

                async def publish(version_id: str, letter: str) -> str:
                    result = await deployment.publish(version_id, snapshots[letter])
                    return result.outcome.value

                async def status() -> RegistryStatus:
                    s: RegistryStatus = await registry.status()
                    return s

                pubs = PublicationLoop(publish, tag=tag)
                if not (await pubs.publish_once()).ok:
                    raise AssertionError(f"the first publication failed: {pubs.records[-1]}")
                # The worker fault needs a short TTL (its lease must expire within the test);
                # the actor fault one longer than the actor's restart, or the workers' own
                # keepers would give their leases up while the registry is away.
                ttl = LEASE_TTL if fault == "worker" else LONG_LEASE_TTL
                started = await asyncio.gather(*(w.start(lease_ttl=ttl) for w in workers))
                pubs.start()
                try:
                    mark = traffic.mark("workers started")
                    await nth_generation(
                        traffic,
                        after,
                        since=mark,
                        tag_prefix=victim.owner if fault == "worker" else None,
                    )
                    if fault == "worker":
                        await _worker_fault(
                            report, victim, started[victim_index], pubs, status, traffic
                        )
                        fault_at = report.times.pop("fault_at") or fault_at
                    else:
                        fault_at = await _actor_fault(report, registry, pubs, workers, traffic)
                    await nth_generation(traffic, 2 * AGENTS, since=traffic.mark("recovered"))
                finally:
                    await pubs.stop()
                    for w in workers:
                        await w.stop()

                async def reclaimed() -> RegistryStatus | None:
                    # Releases happen in the workers' processes, which cannot poke this
                    # process's reclaimer; a reclaim round here stands in for the next
                    # publication attempt, which would run one too.
                    await deployment.reclaim()
                    s = await status()
                    return s if settled(s) else None

                final = await eventually(reclaimed, what="every retired version reclaimed")
                report.problems += ledger_problems(final, pubs.committed)
        finally:
            for w in workers:
                await w.kill()
            with contextlib.suppress(Exception):
                ray.kill(registry.actor, no_restart=True)
        report.problems += wire_problems(taps, traffic)
        for tap in taps.values():
            report.problems += [
                f"an engine was unreachable: {reason}" for _, reason in tap.upstream_failures
            ]
    attempts = [a for w in workers for a in w.attempts()]
    report.requests = len(attempts)
    report.episodes = len({a["session_id"] for a in attempts})
    report.publications = _publication_counts(pubs)
    failed = [a for a in attempts if a["outcome"] != "ok"]
    report.failures = {
        "before": [_line(a) for a in failed if a["end"] < fault_at],
        "in_flight": [_line(a) for a in failed if a["start"] < fault_at <= a["end"]],
        "after": [_line(a) for a in failed if a["start"] >= fault_at],
    }
    untyped = [
        _line(a)
        for a in failed
        if a["start"] >= fault_at and not _typed_refusal(a["outcome"], a["error_code"])
    ]
    if untyped:
        report.problems.append(
            f"{len(untyped)} requests that started after the fault failed otherwise than by a "
            f"typed refusal (nothing sent): {untyped[:8]}"
        )
    for w in workers:
        for e in w.events():
            if e["kind"] == "stopped" and e["errors"]:
                report.problems.append(f"worker {w.owner} agent errors: {e['errors'][:5]}")
    slack = LEASE_TTL + PUBLICATION_SLACK
    report.goals[f"publication within TTL + {PUBLICATION_SLACK:.0f} s"] = (
        report.first_publication_s is not None and report.first_publication_s <= slack
    )
    if not report.goals[f"publication within TTL + {PUBLICATION_SLACK:.0f} s"]:
        report.problems.append(
            f"no publication within {slack:.0f} s of the fault "
            f"(first after {report.first_publication_s} s)"
        )
    return report


#: Typed answers that say nothing was sent and the Session cannot go on: refused while a part was
#: away is the other kind (outcome ``refused``).
_ENDED_SESSION_CODES = frozenset({"SESSION_EXPIRED", "SESSION_CLOSED"})


def _typed_refusal(outcome: str, code: str | None) -> bool:
    """Whether a failed attempt is one a fault may cause without breaking a rule: refused before
    anything was sent (the gateway or the registry was away: the agent may try again, and a bind
    is replayed with its request id), or the typed end of a Session whose lease or name ended.
    Never indeterminate: nothing that was sent was lost."""
    return outcome == "refused" or code in _ENDED_SESSION_CODES


def _line(a: dict[str, Any]) -> str:
    return f"{a['session_id']} {a['outcome']} {a['error_code']} on {a['engine']}"


def _opened(worker: Any, incarnation: str) -> dict[str, Any] | None:
    """The keeper's OPENED event of a worker incarnation, once the worker has written it."""
    return next(
        (
            e
            for e in worker.events()
            if e["kind"] == "lease" and e["event"] == "OPENED" and e["incarnation"] == incarnation
        ),
        None,
    )


async def _lease_opened(worker: Any, incarnation: str) -> dict[str, Any]:
    # The worker writes OPENED after the registry call returns: the registry (and so this
    # process, through status) can see the new lease, and its predecessor's end, first.
    async def probe() -> dict[str, Any] | None:
        return _opened(worker, incarnation)

    found: dict[str, Any] = await eventually(
        probe, what=f"worker {worker.owner} incarnation {incarnation} opened its lease"
    )
    return found


async def _worker_fault(
    report: FaultReport,
    victim: Any,
    first: dict[str, Any],
    pubs: PublicationLoop,
    status: Any,
    traffic: TrafficLog,
) -> None:
    """Kill the victim and let its lease expire; restart it; kill it under a long lease and
    restart it at once. Fills ``report`` (times from the first kill)."""
    lease = str((await _lease_opened(victim, first["incarnation"]))["lease_id"])
    # The versions the victim's Sessions were bound to when it died.
    pinned = {a["lora_name"] for a in victim.attempts(first["incarnation"]) if a["lora_name"]}
    fault_at = now()
    await victim.kill()
    report.times["fault_at"] = fault_at

    def gone(lease_id: str) -> Callable[[], Awaitable[float | None]]:
        async def probe() -> float | None:
            s: RegistryStatus = await status()
            return None if any(x.lease_id == lease_id for x in s.leases) else now()

        return probe

    released = await eventually(gone(lease), what=f"the lease {lease} of the killed worker ended")
    report.times["refs_released_s"] = round(released - fault_at, 3)
    if released - fault_at < LEASE_TTL * 0.5:
        report.problems.append(
            f"lease {lease} ended {released - fault_at:.2f} s after the kill, long before its "
            f"TTL ({LEASE_TTL} s): the check did not watch the right lease"
        )

    async def slots_back() -> float | None:
        # Its refs are gone with its lease; a pinned version still RETIRED with no Session, or
        # RECLAIMING, still holds a slot only because of the dead worker.
        s = await status()
        stuck = [
            v
            for v in s.versions
            if v.lora_name in pinned
            and (
                v.state is VersionState.RECLAIMING
                or (v.state is VersionState.RETIRED and v.session_refs == 0)
            )
        ]
        return None if stuck else now()

    back = await eventually(slots_back, what=f"the slots pinned by {victim.owner} came back")
    report.times["slots_back_s"] = round(back - fault_at, 3)
    report.goals[f"slots back within TTL + 5 s ({LEASE_TTL + 5:.0f} s)"] = (
        back - fault_at <= LEASE_TTL + 5.0
    )
    published = await pubs.wait_success_after(fault_at, what="a publication after the kill")
    report.first_publication_s = _since(published.end, fault_at)

    # The same worker slot again, under a lease that would not expire within the scenario.
    second = await victim.start(lease_ttl=LONG_LEASE_TTL)
    mark = traffic.mark("victim restarted")
    await nth_generation(
        traffic, 3, since=mark, tag_prefix=f"{victim.owner}.{second['incarnation']}"
    )
    long_lease = str((await _lease_opened(victim, second["incarnation"]))["lease_id"])
    killed_again = now()
    await victim.kill()
    restart_at = now()
    # Watched from the moment the new process is spawned, while it starts.
    starting = asyncio.create_task(victim.start(lease_ttl=LEASE_TTL))
    ended = await eventually(
        gone(long_lease),
        what=f"the restarted worker {victim.owner} ended its predecessor's lease {long_lease}",
        limit=LONG_LEASE_TTL / 2,
    )
    third = await starting
    report.back_s = round(now() - killed_again, 3)
    report.times["restart_releases_s"] = round(ended - restart_at, 3)
    opened = (await _lease_opened(victim, third["incarnation"]))["at"]
    report.times["restart_lease_opened_s"] = round(opened - restart_at, 3)
    again = await eventually(
        lambda: _first_ok(victim, third["incarnation"]),
        what=f"the restarted worker {victim.owner} served a generation",
    )
    report.first_affected_generation_s = _since(again, restart_at)
    # The owner is back when its new incarnation opens its lease; the seconds before that are
    # the interpreter and Ray starting (not the product's to shorten).
    report.times["restart_releases_after_lease_s"] = round(ended - opened, 3)
    report.goals["refs released within 5 s of the owner's restart (its new lease)"] = (
        ended - opened <= 5.0
    )


async def _first_ok(worker: Any, incarnation: str) -> float | None:
    return next((a["end"] for a in worker.attempts(incarnation) if a["outcome"] == "ok"), None)


async def _actor_fault(
    report: FaultReport,
    registry: Any,
    pubs: PublicationLoop,
    workers: list[Any],
    traffic: TrafficLog,
) -> float:
    """Kill -9 the registry actor's process; wait for Ray to bring it back from its journal."""
    pid = await registry.actor.pid.remote()
    report.choices["actor_pid"] = pid
    fault_at = now()
    os.kill(pid, signal.SIGKILL)

    async def back() -> float | None:
        try:
            again = await registry.actor.pid.remote()
        except Exception:
            return None
        return now() if again != pid else None

    report.back_s = round(await eventually(back, what="the registry actor restarted") - fault_at, 3)
    published = await pubs.wait_success_after(fault_at, what="a publication after the restart")
    report.first_publication_s = _since(published.end, fault_at)
    # The engines serve a generation again once the actor is back (bound Sessions never
    # needed it; new ones bind through it).
    await nth_generation(traffic, 1, since=traffic.mark("actor back"))
    ends = [
        a["end"]
        for w in workers
        for a in w.attempts()
        if a["outcome"] == "ok" and a["start"] > fault_at
    ]
    report.first_affected_generation_s = _since(min(ends, default=None), fault_at)
    return fault_at
