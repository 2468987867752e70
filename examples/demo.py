"""The agentic-lora demo (``make demo``): a live publication under agent load on two real engines.

Starts two SGLang engines (E0, E1) on the tiny fixture model and walks through one rollout:

1. publish A through the HTTP push plugin (the first version, the default);
2. start the *old* agent Sessions; they bind A at their first turn. One of them (old-0) is in the
   middle of a long generation when
3. B is published (two-phase: loaded and probed on E0 and E1, then committed) without pausing,
   flushing or aborting anything. After the commit a rollout controller interrupts old-0's long
   generation (``/abort_request`` through the Session); the agent resumes it, still on A;
4. *new* Sessions start and bind B; old Sessions go on with tool turns, a refused-prompt retry
   and their final answers, all on A;
5. C is refused for capacity (A retired but still bound, B published: 2 of 2 slots) before any
   engine call;
6. the old Sessions close; the background reclaimer unloads A, once per engine;
7. C is published; a *late* Session binds C.

Then it prints a report (per-Session versions and turns, the publication timeline with phase
durations, request latencies, the checks) and always stops the engines, also on Ctrl-C or an
error. Exit status: 0 when every check passed, 1 when one failed, 2 on an error.

The tiny model's output is noise, so the choice of tool comes from each task's scripted plan (see
``agentic_lora_agent.policy``); every generation still runs on the engines through the middleware.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import signal
import sys
import time
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Mapping
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
from agentic_lora_agent import AgentConfig
from agentic_lora_agent import AgentObserver
from agentic_lora_agent import AttemptKind
from agentic_lora_agent import AttemptOutcome
from agentic_lora_agent import AttemptRecord
from agentic_lora_agent import Episode
from agentic_lora_agent import EpisodeStatus
from agentic_lora_agent import PlanStep
from agentic_lora_agent import ScriptedPolicy
from agentic_lora_agent import Task
from agentic_lora_agent import ToolAgent
from agentic_lora_agent import ToolBox
from agentic_lora_agent import default_toolbox
from agentic_lora_agent import episode_json
from agentic_lora_agent import episode_line
from agentic_lora_agent import filler_document
from agentic_lora_agent import percentiles
from agentic_lora_agent.tasks import TASKS
from agentic_lora_harness.engine_env import ensure_engine_env
from agentic_lora_harness.engines import EngineFleet
from agentic_lora_harness.exit_status import failures_exit
from agentic_lora_harness.fixture import Fixture
from agentic_lora_harness.fixture import FixtureSpec
from agentic_lora_harness.fixture import build_fixture
from agentic_lora_http import HttpPushBackend

from agentic_lora.adapters.snapshot import AdapterSnapshot
from agentic_lora.assembly.deployment import Deployment
from agentic_lora.config import AgenticLoRASettings
from agentic_lora.config import load_settings
from agentic_lora.config import verify_fleet
from agentic_lora.engines.admin import AdminTimeouts
from agentic_lora.engines.backends import EngineRef
from agentic_lora.engines.transport import EngineReply
from agentic_lora.engines.transport import EngineTransport
from agentic_lora.errors import AgenticLoRAError
from agentic_lora.foundation.http_limits import engine_limits
from agentic_lora.foundation.requests import Route
from agentic_lora.publication.publisher import Phase
from agentic_lora.publication.publisher import PhaseEvent
from agentic_lora.publication.publisher import PhaseStatus
from agentic_lora.publication.publisher import PublicationResult
from agentic_lora.registry.types import VersionState
from agentic_lora.session import Versioning

# Engine endpoints a publication must never touch: each would stall or disturb live Sessions.
FORBIDDEN_PATHS = ("/pause_generation", "/flush_cache", "/release_memory_occupation")
#: Engine reads that change nothing (the repairer's incarnation probe, health checks).
_READ_ONLY_PATHS = frozenset({"/server_info", "/get_server_info", "/v1/models", "/health"})

# What these endpoints leave in an SGLang log when something calls them.
FORBIDDEN_LOG_MARKERS = (*FORBIDDEN_PATHS, "Cache flushed")


# --- what went over the wire --------------------------------------------------------------------


@dataclass
class WireEvent:
    """One HTTP request this process sent to an engine."""

    source: str  # "session" (generations, aborts) or "backend" (publication and reclaim)
    engine: str
    path: str
    body: Mapping[str, Any]
    started: float
    ended: float | None = None
    status: int | None = None
    error: str | None = None

    @property
    def seconds(self) -> float | None:
        return None if self.ended is None else self.ended - self.started


class WireLog:
    """Everything sent to the engines, by both the Sessions and the HTTP push backend."""

    def __init__(self, engines: Sequence[EngineRef], clock: Callable[[], float]) -> None:
        self.events: list[WireEvent] = []
        self._clock = clock
        self._by_url = {e.base_url.rstrip("/"): e.name for e in engines}
        self._pending: dict[int, WireEvent] = {}

    def start(self, source: str, engine: str, path: str, body: Mapping[str, Any]) -> WireEvent:
        event = WireEvent(source, engine, path, dict(body), self._clock())
        self.events.append(event)
        return event

    def finish(self, event: WireEvent, *, status: int | None, error: str | None = None) -> None:
        event.ended, event.status, event.error = self._clock(), status, error

    async def on_request(self, request: httpx.Request) -> None:
        """httpx request hook for the backend's client."""
        base = f"{request.url.scheme}://{request.url.netloc.decode()}"
        body: Any = {}
        if request.content:
            with contextlib.suppress(ValueError):
                body = json.loads(request.content)
        engine = self._by_url.get(base, base)
        event = self.start(
            "backend", engine, request.url.path, body if isinstance(body, dict) else {}
        )
        self._pending[id(request)] = event

    async def on_response(self, response: httpx.Response) -> None:
        """httpx response hook for the backend's client."""
        event = self._pending.pop(id(response.request), None)
        if event is not None:
            self.finish(event, status=response.status_code)

    def between(self, start: float, end: float, source: str | None = None) -> list[WireEvent]:
        return [
            e
            for e in self.events
            if start <= e.started <= end and (source is None or e.source == source)
        ]


class RecordingTransport(EngineTransport):
    """The library's engine transport, logging each generation and abort it sends."""

    def __init__(self, engines: Sequence[EngineRef], *, wire: WireLog, **options: Any) -> None:
        super().__init__(engines, **options)
        self._wire = wire

    async def send(self, engine: str, path: str, body: Mapping[str, Any]) -> EngineReply:
        event = self._wire.start("session", engine, path, body)
        try:
            reply = await super().send(engine, path, body)
        except AgenticLoRAError as exc:
            self._wire.finish(event, status=exc.details.get("status"), error=exc.code)
            raise
        self._wire.finish(event, status=reply.status_code)
        return reply

    async def abort(self, engine: str, rid: str) -> None:
        event = self._wire.start("session", engine, "/abort_request", {"rid": rid})
        try:
            await super().abort(engine, rid)
        except AgenticLoRAError as exc:
            self._wire.finish(event, status=exc.details.get("status"), error=exc.code)
            raise
        self._wire.finish(event, status=200)


# --- the timeline ---------------------------------------------------------------------------------


@dataclass
class Timeline:
    """Milestones and the publisher's/reclaimer's phase events, stamped with one clock."""

    clock: Callable[[], float]
    t0: float
    marks: list[tuple[float, str]] = field(default_factory=list)
    phases: list[tuple[float, PhaseEvent]] = field(default_factory=list)

    def rel(self, t: float) -> float:
        return t - self.t0

    def mark(self, text: str) -> float:
        now = self.clock()
        self.marks.append((now, text))
        print(f"  [{self.rel(now):7.2f} s] {text}", flush=True)
        return now

    def on_progress(self, event: PhaseEvent) -> None:
        self.phases.append((self.clock(), event))

    def phase_time(
        self, phase: Phase, status: PhaseStatus, start: float, end: float
    ) -> float | None:
        for t, event in self.phases:
            if start <= t <= end and event.phase is phase and event.status is status:
                return t
        return None


# --- agents ---------------------------------------------------------------------------------------


class DemoObserver(AgentObserver):
    """Holds an agent at a turn boundary until released; marks its binding, retries and resumes."""

    def __init__(
        self,
        tl: Timeline,
        versions: Mapping[str, str],
        *,
        hold_from_turn: int | None = None,
        release: asyncio.Event | None = None,
    ) -> None:
        self.tl = tl
        self.versions = versions  # lora_name -> version id, filled in as versions are published
        self.hold_from_turn = hold_from_turn
        self.release = release
        self.bound = asyncio.Event()
        self.long_rid: str | None = None
        self.long_dispatched = asyncio.Event()
        self.long_ended = asyncio.Event()
        self.long_turn: int | None = None

    async def before_turn(self, agent: ToolAgent, turn: int) -> None:
        held = self.hold_from_turn is not None and turn >= self.hold_from_turn
        if held and self.release is not None:
            await self.release.wait()

    def on_dispatch(self, agent: ToolAgent, turn: int, kind: AttemptKind, rid: str) -> None:
        if turn == self.long_turn and kind is AttemptKind.FIRST:
            self.long_rid = rid
            self.long_dispatched.set()

    def on_attempt(self, agent: ToolAgent, record: AttemptRecord) -> None:
        version = self.versions.get(record.lora_name or "", "?")
        where = f"on {record.engine or '-'} with {version}"
        if agent.session.binding is not None and not self.bound.is_set():
            self.bound.set()
            self.tl.mark(f"{record.session_id} bound {version} at its first turn ({where})")
        if record.kind is not AttemptKind.FIRST or record.outcome is not AttemptOutcome.OK:
            detail = f"HTTP {record.http_status}" if record.http_status else ""
            if record.outcome is AttemptOutcome.ABORTED:
                detail = f"after {record.completion_tokens} tokens"
            self.tl.mark(
                f"{record.session_id} turn {record.turn}: {record.kind.value} "
                f"{record.outcome.value} {where}" + (f" ({detail})" if detail else "")
            )
        if record.rid == self.long_rid:
            self.long_ended.set()


@dataclass
class Run:
    """One agent Session of the scenario."""

    session_id: str
    group: str  # old / new / late
    task: Task
    observer: DemoObserver
    agent: ToolAgent | None = None
    episode: Episode | None = None
    closing_at: float | None = None  # the episode ended; the Session starts closing
    closed_at: float | None = None
    task_handle: asyncio.Task[None] | None = None


# --- the scenario ---------------------------------------------------------------------------------


@dataclass
class Options:
    """The scenario's sizes (see ``--help``)."""

    old_sessions: int
    new_sessions: int
    turn_tokens: int
    long_turn_tokens: int
    manual_words: int


@dataclass
class Outcome:
    """Everything the report needs."""

    fleet_engines: list[tuple[str, str]]
    names: dict[str, str]  # lora_name -> A/B/C
    runs: list[Run]
    publications: list[tuple[str, float, float, PublicationResult]]  # label, start, end, result
    timeline: Timeline
    wire: WireLog
    checks: list[tuple[bool, str, str]]
    states: dict[str, str]
    windows: dict[str, tuple[float, float]]
    #: The version each chunk of the streamed turn named (from its Session's binding).
    streamed: list[str | None] = field(default_factory=list)


def _tasks(opts: Options) -> tuple[Task, Task, list[Task], list[Task], Task]:
    """old-0's task (a long turn), old-1's (a refused prompt), the rest, the new ones, the late one."""
    long_task = dataclasses.replace(TASKS["oslo-plus"], turn_max_tokens={1: opts.long_turn_tokens})
    manual_task = Task(
        "manual",
        "Read the engine manual, then compute 2 ** 10.",
        plan=(
            PlanStep("calculator", {"expression": "2 ** 5"}),
            PlanStep("lookup", {"key": "engine manual"}),
            PlanStep("calculator", {"expression": "2 ** 10"}),
        ),
        expected_answer="1024",
    )
    others = [TASKS["two-cities"], TASKS["everest-days"], TASKS["fahrenheit"]]
    new = [TASKS["fahrenheit"], TASKS["light-minute"], TASKS["two-cities"]]
    return long_task, manual_task, others, new, TASKS["everest-days"]


@dataclass
class Publications:
    """Every publish call of the scenario, timed, and the version id of each published name."""

    tl: Timeline
    entries: list[tuple[str, float, float, PublicationResult]] = field(default_factory=list)
    versions: dict[str, str] = field(default_factory=dict)  # lora_name -> version id

    async def publish(
        self, d: Deployment, label: str, version_id: str, snapshot: AdapterSnapshot
    ) -> PublicationResult:
        start = self.tl.clock()
        result = await d.publish(version_id, snapshot)
        end = self.tl.clock()
        self.entries.append((label, start, end, result))
        if result.lora_name is not None:
            self.versions[result.lora_name] = version_id
        reason = f" ({result.reason})" if result.reason else ""
        self.tl.mark(f"publish {version_id}: {result.outcome.value} in {end - start:.2f} s{reason}")
        return result


async def _run_agent(
    d: Deployment, run: Run, tools: ToolBox, config: AgentConfig, tl: Timeline
) -> None:
    async with d.session(run.session_id) as s:
        run.agent = ToolAgent(
            s, run.task, tools=tools, config=config, policy=ScriptedPolicy(), observer=run.observer
        )
        run.episode = await run.agent.run()
        run.closing_at = tl.clock()
    run.closed_at = tl.clock()


async def _wait_for(run: Run, event: asyncio.Event, what: str) -> None:
    """Wait for ``event`` of ``run``'s agent; fail at once if the agent ended without it."""
    assert run.task_handle is not None
    waiter = asyncio.ensure_future(event.wait())
    await asyncio.wait({waiter, run.task_handle}, return_when=asyncio.FIRST_COMPLETED)
    if not event.is_set():
        waiter.cancel()
        if run.task_handle.done() and run.task_handle.exception() is not None:
            raise RuntimeError(f"{run.session_id} crashed") from run.task_handle.exception()
        status = run.episode.status.value if run.episode else "unknown"
        raise RuntimeError(f"{run.session_id} ended ({status}) before it {what}")


async def _interrupt_until_ended(run: Run) -> int:
    """Abort old-0's long generation; repeat while SGLang has not registered it yet."""
    assert run.agent is not None
    assert run.task_handle is not None
    sent = 0
    while not run.observer.long_ended.is_set() and not run.task_handle.done():
        # Only the long generation: once it ended, the agent's resume is left alone.
        if run.agent.in_flight_rid == run.observer.long_rid and await run.agent.interrupt():
            sent += 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(run.observer.long_ended.wait(), 0.25)
    return sent


def _settings(fleet: EngineFleet) -> AgenticLoRASettings:
    return load_settings(
        enable_versioned_lora_publication=True,
        engines=[f"{name}={url}" for name, url in fleet.engines],
        capacity=2,
        base_model_name=fleet.served_model_name,
        engine_max_loaded_loras=3,
        engine_max_loras_per_batch=3,
        request_timeout=300.0,
    )


async def scenario(fleet: EngineFleet, fixture: Fixture, opts: Options, store: Path) -> Outcome:
    clock = time.perf_counter
    tl = Timeline(clock, clock())
    settings = _settings(fleet)
    wire = WireLog(settings.engines, clock)
    transport = RecordingTransport(
        settings.engines, wire=wire, request_timeout=settings.request_timeout
    )
    limits = AdminTimeouts()
    client = httpx.AsyncClient(
        timeout=httpx.Timeout(limits.read, connect=limits.connect),
        limits=engine_limits(),
        event_hooks={"request": [wire.on_request], "response": [wire.on_response]},
    )
    snapshots = {name: AdapterSnapshot.from_peft_dir(fixture.adapter(name)) for name in "ABC"}
    long_task, manual_task, others, new_tasks, late_task = _tasks(opts)
    tools = default_toolbox({"engine manual": filler_document(opts.manual_words)})
    config = AgentConfig(
        max_tokens=opts.turn_tokens,
        temperature=0.0,
        # Every turn generates exactly its budget: the tiny model's EOS would end turns at random.
        extra_body={"ignore_eos": True},
    )
    pubs = Publications(tl)
    versions = pubs.versions
    windows: dict[str, tuple[float, float]] = {}
    runs: list[Run] = []
    streamed: list[str | None] = []
    try:
        await verify_fleet(settings, transport)
        versioning = Versioning.from_settings(settings, transport=transport)
        backend = HttpPushBackend(str(store), client=client)
        async with Deployment(
            settings=settings,
            versioning=versioning,
            backend=backend,
            on_progress=tl.on_progress,
        ) as d:
            # 1. A, the first version.
            if not (await pubs.publish(d, "A", "A", snapshots["A"])).ok:
                raise RuntimeError("the first publication failed; see the log above")

            # 2. Old Sessions: bind A; held before turn 2 until B is committed and C refused.
            release_old = asyncio.Event()
            old_tasks = [long_task, manual_task, *others][: opts.old_sessions]
            for i, task in enumerate(old_tasks):
                observer = DemoObserver(tl, versions, hold_from_turn=2, release=release_old)
                runs.append(Run(f"old-{i}", "old", task, observer))
            runs[0].observer.long_turn = 1
            for run in runs:
                run.task_handle = asyncio.create_task(_run_agent(d, run, tools, config, tl))
            tl.mark(f"{len(runs)} old Sessions started")
            for run in runs:
                await _wait_for(run, run.observer.bound, "bound a version")
            await _wait_for(runs[0], runs[0].observer.long_dispatched, "started its long turn")
            tl.mark(
                f"old Sessions bound; old-0's long turn ({opts.long_turn_tokens} tokens) is running"
            )

            # 3. B, while they run; then interrupt old-0's long generation and let it resume.
            b = await pubs.publish(d, "B", "B", snapshots["B"])
            if not b.ok:
                raise RuntimeError("publishing B failed; see the log above")
            aborts = await _interrupt_until_ended(runs[0])
            tl.mark(f"old-0 interrupted (/abort_request sent {aborts}x); it resumes on its version")

            # 4. New Sessions bind B.
            new_runs = [
                Run(f"new-{i}", "new", task, DemoObserver(tl, versions))
                for i, task in enumerate(new_tasks[: opts.new_sessions])
            ]
            for run in new_runs:
                run.task_handle = asyncio.create_task(_run_agent(d, run, tools, config, tl))
            runs.extend(new_runs)
            for run in new_runs:
                await _wait_for(run, run.observer.bound, "bound a version")
            tl.mark(f"{len(new_runs)} new Sessions started and bound")

            # 4b. One streamed turn of a new Session: every chunk names the Session's version.
            async with d.session("stream-0") as s:
                turn = {
                    "messages": [{"role": "user", "content": "Say hello."}],
                    "max_tokens": 8,
                    "temperature": 0.0,
                    "ignore_eos": True,
                }
                streamed = [c.version_id async for c in s.stream(Route.CHAT_COMPLETIONS, turn)]
            tl.mark(
                f"stream-0 streamed one turn: {len(streamed)} chunks, each naming version "
                f"{', '.join(sorted({str(v) for v in streamed}))}"
            )

            # 5. C: A is retired but bound, B is published: no slot, refused before any transfer.
            c_start = clock()
            c_skipped = await pubs.publish(d, "C (A still bound)", "C", snapshots["C"])
            windows["c_refused"] = (c_start, clock())
            if c_skipped.ok:
                raise RuntimeError("C was published while A was still bound: capacity not enforced")

            # 6. Old Sessions finish on A and close; the reclaimer unloads A in the background.
            release_old.set()
            old_handles = [r.task_handle for r in runs if r.group == "old" and r.task_handle]
            await asyncio.gather(*old_handles)
            last_closing = max(r.closing_at or 0.0 for r in runs if r.group == "old")
            tl.mark("old Sessions finished and closed")
            await d.reclaimer.settled()
            windows["a_reclaim"] = (last_closing, clock())
            status_a = await d.registry.version("A")
            tl.mark(f"A is {status_a.state.value}")

            # 7. C now fits; a late Session binds it.
            await pubs.publish(d, "C", "C", snapshots["C"])
            late = Run("late-0", "late", late_task, DemoObserver(tl, versions))
            late.task_handle = asyncio.create_task(_run_agent(d, late, tools, config, tl))
            runs.append(late)
            await asyncio.gather(*(r.task_handle for r in runs if r.task_handle))
            tl.mark("every Session finished and closed")
            await d.reclaimer.settled()
            status = await d.status()
            states = {v.version_id: v.state.value for v in status.versions}
            names = {v.lora_name: v.version_id for v in status.versions}
    finally:
        for run in runs:
            if run.task_handle is not None and not run.task_handle.done():
                run.task_handle.cancel()
        await transport.aclose()
        await client.aclose()
    outcome = Outcome(
        fleet.engines, names, runs, pubs.entries, tl, wire, [], states, windows, streamed
    )
    outcome.checks = run_checks(outcome, fleet)
    return outcome


# --- checks ---------------------------------------------------------------------------------------


def _check(checks: list[tuple[bool, str, str]], ok: bool, name: str, detail: str = "") -> None:
    checks.append((ok, name, detail))


def _by_name(outcome: Outcome, version: str) -> str:
    return next(name for name, v in outcome.names.items() if v == version)


def run_checks(outcome: Outcome, fleet: EngineFleet) -> list[tuple[bool, str, str]]:
    """Every invariant the demo promises, each with what was seen."""
    checks: list[tuple[bool, str, str]] = []
    base = fleet.served_model_name
    episodes = [r.episode for r in outcome.runs if r.episode is not None]
    a, b, c = (_by_name(outcome, v) for v in "ABC")
    wire_by_rid = {
        e.body.get("rid"): e for e in outcome.wire.events if e.path == "/v1/chat/completions"
    }

    # One version per Session, as the agent recorded it, as sent, and as the engine answered.
    mixed = []
    for ep in episodes:
        sent = {wire_by_rid[x.rid].body.get("model") for x in ep.attempts if x.rid in wire_by_rid}
        echoed = {x.served_model for x in ep.attempts if x.served_model is not None}
        expected = {f"{base}:{ep.lora_name}"}
        if len(ep.lora_names) != 1 or sent != expected or not echoed <= expected:
            mixed.append(ep.session_id)
    _check(
        checks,
        not mixed and len(episodes) == len(outcome.runs),
        "every Session's requests carried one version (recorded, sent and echoed by the engine)",
        f"{sum(len(e.attempts) for e in episodes)} requests in {len(episodes)} Sessions"
        + (f"; mixed: {mixed}" if mixed else ""),
    )
    expect = {"old": a, "new": b, "late": c}
    bound = {r.session_id: r.episode.lora_name if r.episode else None for r in outcome.runs}
    wrong = [
        f"{r.session_id}={outcome.names.get(bound[r.session_id] or '', '?')}"
        for r in outcome.runs
        if bound[r.session_id] != expect[r.group]
    ]
    _check(
        checks,
        not wrong,
        "old Sessions bound A, new ones B, the late one C",
        ", ".join(wrong) or "as expected",
    )

    # Old Sessions kept A after B's commit, including a tool turn, the retry and the resume.
    b_start, b_end = next((s, e) for label, s, e, _ in outcome.publications if label == "B")
    commit = outcome.timeline.phase_time(Phase.COMMIT, PhaseStatus.DONE, b_start, b_end) or b_end
    olds = [r for r in outcome.runs if r.group == "old"]
    after = [x for r in olds if r.episode for x in r.episode.attempts if x.started_at > commit]
    versions_after = sorted({outcome.names.get(x.lora_name or "", "?") for x in after})
    _check(
        checks,
        {x.session_id for x in after} == {r.session_id for r in olds}
        and {x.lora_name for x in after} == {a},
        "after B's commit every old Session kept generating on A",
        f"{len(after)} requests after the commit, versions {versions_after}",
    )
    old0 = olds[0].episode
    long_attempts = [x for x in (old0.attempts if old0 else ()) if x.turn == 1]
    kinds = [(x.kind, x.outcome) for x in long_attempts]
    aborted = long_attempts[0] if long_attempts else None
    # Generations in flight at any moment of B's publication: the long one spans all of it.
    during = [
        x
        for ep in episodes
        for x in ep.attempts
        if x.started_at < b_end and x.started_at + x.latency_s > b_start
    ]
    undisturbed = [
        x
        for x in during
        if x.outcome is AttemptOutcome.OK or (x is aborted and x.started_at + x.latency_s > b_end)
    ]
    spans = (
        aborted is not None
        and aborted.started_at < b_start
        and aborted.started_at + aborted.latency_s > commit
    )
    _check(
        checks,
        spans and len(during) >= 2 and undisturbed == during,
        "generations ran through B's whole publication, none paused, failed or aborted by it",
        f"{len(during)} in flight during it; old-0's long turn spanned it "
        f"({aborted.completion_tokens if aborted else 0} tokens when aborted after the commit)",
    )
    abort_events = [e for e in outcome.wire.events if e.path == "/abort_request"]
    resumed_ok = (
        len(kinds) >= 2
        and kinds[0] == (AttemptKind.FIRST, AttemptOutcome.ABORTED)
        and kinds[-1] == (AttemptKind.RESUME, AttemptOutcome.OK)
        and {x.lora_name for x in long_attempts} == {a}
        and aborted is not None
        and any(
            e.body.get("rid") == aborted.rid and e.engine == aborted.engine for e in abort_events
        )
    )
    _check(
        checks,
        resumed_ok,
        "abort/resume after the commit: aborted on its engine by rid, resumed on A",
        " -> ".join(f"{k.value}:{o.value}" for k, o in kinds),
    )
    retries = [
        (x, y)
        for r in olds
        if r.episode
        for x, y in zip(r.episode.attempts, r.episode.attempts[1:], strict=False)
        if x.outcome is AttemptOutcome.REFUSED and y.kind is AttemptKind.RETRY
    ]
    _check(
        checks,
        any(
            x.http_status == 400
            and y.outcome is AttemptOutcome.OK
            and x.lora_name == y.lora_name == a
            and x.started_at > commit
            for x, y in retries
        ),
        "retry after the commit: a prompt the engine refused (HTTP 400) was shortened and "
        "retried on A",
        f"{len(retries)} retried turn(s)",
    )

    # Capacity: C refused before any engine call while A was bound; accepted after A's reclaim.
    c_label = "C (A still bound)"
    c_refused = next(r for label, _, _, r in outcome.publications if label == c_label)
    start, end = outcome.windows["c_refused"]
    # The repairer's background incarnation probe reads /server_info and /v1/models at any time;
    # what must not happen is any call that moves an adapter.
    calls = [
        e
        for e in outcome.wire.between(start, end, source="backend")
        if e.path not in _READ_ONLY_PATHS
    ]
    _check(
        checks,
        c_refused.outcome.value == "SKIPPED" and c_refused.reason == "CAPACITY_ERROR" and not calls,
        "C refused for capacity (A retired but bound, B published) with no adapter call",
        f"{c_refused.outcome.value} {c_refused.reason}, {len(calls)} adapter calls",
    )
    unloads = [
        e
        for e in outcome.wire.events
        if e.path == "/unload_lora_adapter" and e.body.get("lora_name") == a
    ]
    per_engine = sorted(e.engine for e in unloads)
    last_a_closing = outcome.windows["a_reclaim"][0]
    last_a_request = max(
        (x.started_at + x.latency_s for ep in episodes for x in ep.attempts if x.lora_name == a),
        default=0.0,
    )
    _check(
        checks,
        per_engine == sorted(n for n, _ in outcome.fleet_engines)
        and all(e.started >= last_a_closing >= last_a_request for e in unloads)
        and outcome.states.get("A") == VersionState.RECLAIMED.value,
        "A reclaimed after its last Session closed: unloaded exactly once per engine",
        f"unloads of A: {per_engine}; A is {outcome.states.get('A')}",
    )
    c_final = [r for label, _, _, r in outcome.publications if label == "C"]
    _check(
        checks,
        bool(c_final) and c_final[0].ok,
        "C published once A's slot was free",
        c_final[0].outcome.value if c_final else "not attempted",
    )

    # Nothing disruptive was ever sent, and the engines' own logs agree.
    forbidden = [e.path for e in outcome.wire.events if e.path in FORBIDDEN_PATHS]
    abort_all = [e for e in abort_events if not e.body.get("rid") or e.body.get("abort_all")]
    in_logs = [
        f"{name}: {marker}"
        for name in fleet.names
        for marker in FORBIDDEN_LOG_MARKERS
        if marker in fleet.log_path(name).read_text(errors="replace")
    ]
    _check(
        checks,
        not forbidden and not abort_all and not in_logs,
        "no /pause_generation, /flush_cache or abort-all was sent (wire log and engine logs)",
        f"{len(outcome.wire.events)} engine requests, {len(abort_events)} aborts, all by rid"
        + (f"; found {forbidden + in_logs}" if forbidden or in_logs else ""),
    )

    _check(
        checks,
        len(outcome.streamed) > 1 and set(outcome.streamed) == {"B"},
        "a streamed turn of a new Session carried B on every chunk",
        f"{len(outcome.streamed)} chunks: {sorted({str(v) for v in outcome.streamed})}",
    )

    # The episodes themselves: answered, and the tools computed what the plans should give.
    unanswered = [e.session_id for e in episodes if e.status is not EpisodeStatus.ANSWERED]
    wrong_answers = [
        r.session_id
        for r in outcome.runs
        if r.episode is not None
        and r.task.expected_answer is not None
        and (r.episode.observations[-1:] or ("",))[0] != r.task.expected_answer
    ]
    _check(
        checks,
        not unanswered and not wrong_answers,
        "every episode ended with an answer; every tool chain computed the expected result",
        f"unanswered {unanswered}, wrong {wrong_answers}" if unanswered or wrong_answers else "all",
    )
    return checks


# --- report ---------------------------------------------------------------------------------------


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds >= 0.001 else f"{seconds * 1e6:.0f} us"


def _publication_line(label: str, result: PublicationResult, engines: Iterable[str]) -> str:
    parts = [f"{label:<18} {result.outcome.value:<10}"]
    if result.reason:
        parts.append(result.reason)
    if any(t.phase is Phase.PREPARE for t in result.timings):
        parts.append(f"reserve {_ms(result.seconds(Phase.RESERVE))}")
        for engine in engines:
            parts.append(
                f"{engine}: prepare {_ms(result.seconds(Phase.PREPARE, engine))}"
                f" (load + probe), ready {_ms(result.seconds(Phase.RECORD_READY, engine))}"
            )
        parts.append(f"commit {_ms(result.seconds(Phase.COMMIT))}")
    return " | ".join(parts)


def print_report(outcome: Outcome, fleet: EngineFleet, walls: Mapping[str, float]) -> None:
    short = sorted(outcome.names.items())
    engines = [name for name, _ in outcome.fleet_engines]
    tl = outcome.timeline
    print("\n" + "=" * 100)
    print("agentic-lora demo report")
    print("=" * 100)
    print("\nEngines")
    for name, url in outcome.fleet_engines:
        print(
            f"  {name}  {url}  healthy after {fleet.startup_seconds(name)} s  log {fleet.log_path(name)}"
        )
    print("\nVersions")
    for lora_name, version in short:
        print(f"  {version}  {lora_name}  final state {outcome.states.get(version)}")

    print("\nPublications (phase durations; prepare runs on E0 and E1 concurrently)")
    for label, start, end, result in outcome.publications:
        print(
            f"  t={tl.rel(start):6.2f} s  took {end - start:5.2f} s  "
            + _publication_line(label, result, engines)
        )
    print("\nReclaims (unloads sent by the background reclaimer)")
    for e in outcome.wire.events:
        if e.path == "/unload_lora_adapter" and e.source == "backend":
            version = outcome.names.get(str(e.body.get("lora_name")), "?")
            took = f"{_ms(e.seconds)}" if e.seconds is not None else "?"
            print(
                f"  t={tl.rel(e.started):6.2f} s  unload {version} on {e.engine}: HTTP {e.status}, {took}"
            )

    print("\nTimeline")
    for t, text in outcome.timeline.marks:
        print(f"  {tl.rel(t):7.2f} s  {text}")

    print("\nSessions  (turn sources: P = fallback policy, M = model, A = answer)")
    for run in outcome.runs:
        if run.episode is None:
            print(f"  {run.session_id:<10} did not finish")
            continue
        print(
            "  "
            + episode_line(run.episode, short_names=[(n, v) for n, v in short])
            + f" task={run.task.task_id} -> {run.episode.observations[-1:]}"
        )

    print("\nRequests, one line each (tokens: prompt / of which cached / generated)")
    print(
        f"  {'session':<8} {'turn':>4} {'try':>3} {'kind':<8} {'outcome':<8} {'ver':<3} "
        f"{'engine':<6} {'prompt':>6} {'cached':>6} {'gen':>4} {'latency':>8} {'logprob':>9}"
    )
    for run in outcome.runs:
        for x in run.episode.attempts if run.episode else ():
            version = outcome.names.get(x.lora_name or "", "-")
            print(
                f"  {x.session_id:<8} {x.turn:>4} {x.attempt:>3} {x.kind.value:<8} "
                f"{x.outcome.value:<8} {version:<3} {x.engine or '-':<6} {x.prompt_tokens:>6} "
                f"{x.cached_tokens:>6} {x.completion_tokens:>4} {x.latency_s:>7.3f}s "
                f"{x.logprob:>9.2f}"
            )

    print("\nLatency")
    attempts = [x for r in outcome.runs if r.episode for x in r.episode.attempts]
    # Ordinary turns: everything that succeeded except old-0's deliberately long turn.
    regular = [
        x
        for x in attempts
        if x.outcome is AttemptOutcome.OK and not (x.session_id == "old-0" and x.turn == 1)
    ]
    stats = percentiles(x.latency_s for x in regular)
    if stats is not None:
        print(
            f"  {stats.count} ordinary turns ({regular[0].completion_tokens} tokens each): p50 {stats.p50:.3f} s, p95 {stats.p95:.3f} s, "
            f"p99 {stats.p99:.3f} s, max {stats.maximum:.3f} s"
        )
    every = percentiles(x.latency_s for x in attempts)
    if every is not None:
        print(
            f"  all {every.count} requests (incl. refused, aborted, resumed): p50 {every.p50:.3f} s, "
            f"p95 {every.p95:.3f} s, p99 {every.p99:.3f} s, max {every.maximum:.3f} s"
        )
    tokens = sum(x.completion_tokens for x in attempts)
    cached = sum(x.cached_tokens for x in attempts)
    prompt = sum(x.prompt_tokens for x in attempts)
    print(
        f"  {tokens} tokens generated; {cached} of {prompt} prompt tokens served from the prefix cache"
    )

    print("\nChecks")
    for ok, name, detail in outcome.checks:
        print(f"  {'PASS' if ok else 'FAIL'}  {name}" + (f"  [{detail}]" if detail else ""))
    print("\nWall time: " + ", ".join(f"{k} {v:.1f} s" for k, v in walls.items()))


def report_json(outcome: Outcome, walls: Mapping[str, float]) -> dict[str, Any]:
    tl = outcome.timeline
    return {
        "walls_seconds": dict(walls),
        "versions": {
            v: {"lora_name": n, "state": outcome.states.get(v)} for n, v in outcome.names.items()
        },
        "publications": [
            {
                "label": label,
                "start": tl.rel(start),
                "seconds": end - start,
                "outcome": r.outcome.value,
                "reason": r.reason,
                "timings": [
                    {"engine": t.engine, "phase": t.phase.value, "seconds": t.seconds, "ok": t.ok}
                    for t in r.timings
                ],
            }
            for label, start, end, r in outcome.publications
        ],
        "timeline": [{"t": tl.rel(t), "event": text} for t, text in tl.marks],
        "sessions": [episode_json(r.episode) for r in outcome.runs if r.episode is not None],
        "wire": [
            {
                "source": e.source,
                "engine": e.engine,
                "path": e.path,
                "t": tl.rel(e.started),
                "seconds": e.seconds,
                "status": e.status,
                "error": e.error,
            }
            for e in outcome.wire.events
        ],
        "checks": [
            {"ok": ok, "check": name, "detail": detail} for ok, name, detail in outcome.checks
        ],
    }


# --- main -----------------------------------------------------------------------------------------


#: The scenario's sizes (:class:`Options`), each an integer option: (flag, default, help).
_SIZES: tuple[tuple[str, int, str], ...] = (
    ("--old-sessions", 3, "Sessions running when B is published (>= 2)"),
    ("--new-sessions", 2, "Sessions started after B's commit"),
    ("--turn-tokens", 24, "tokens per ordinary turn"),
    ("--long-turn-tokens", 400, "old-0's long turn: must outlast B's publication"),
    ("--manual-words", 6000, "size of the lookup entry that overflows the 4096-token context"),
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="agentic-lora demo on two real SGLang engines")
    for flag, default, help_text in _SIZES:
        p.add_argument(flag, type=int, default=default, help=help_text)
    p.add_argument(
        "--fixture-json",
        type=Path,
        help="the fixture as printed by `python -m agentic_lora_harness.fixture` (default: build "
        "or find it here)",
    )
    return p


def _load_fixture(path: Path) -> Fixture:
    """The fixture ``scripts/demo.sh`` already built (saves re-importing torch to hash its key)."""
    found = json.loads(path.read_text())
    spec = FixtureSpec()
    if found["served_model_name"] != spec.served_model_name:
        raise SystemExit(f"{path} describes a fixture of another spec")
    return Fixture(
        root=Path(found["root"]),
        key=found["key"],
        spec=spec,
        model_dir=Path(found["model_dir"]),
        adapters_dir=Path(found["adapters_dir"]),
        adapters={name: Path(p) for name, p in found["adapters"].items()},
    )


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.old_sessions < 2 or args.new_sessions < 1:
        raise SystemExit("need at least 2 old Sessions and 1 new Session")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGTERM, _terminate)
    opts = Options(
        args.old_sessions,
        args.new_sessions,
        args.turn_tokens,
        args.long_turn_tokens,
        args.manual_words,
    )
    t_begin = time.perf_counter()
    env = ensure_engine_env()
    fixture = _load_fixture(args.fixture_json) if args.fixture_json else build_fixture()
    print(
        f"engine venv: SGLang {env.sglang_version}, torch {env.torch_version} "
        f"({'CPU shim' if env.needs_cpu_shim else 'GPU'}); fixture {fixture.root}"
    )
    walls: dict[str, float] = {}
    fleet = EngineFleet(env, fixture, count=2)
    print("starting E0 and E1 ...", flush=True)
    t_start = time.perf_counter()
    with failures_exit("demo"):
        with fleet:
            walls["engine start"] = time.perf_counter() - t_start
            print(
                f"engines healthy after {walls['engine start']:.1f} s; logs in {fleet.log_dir}\n",
                flush=True,
            )
            t_scenario = time.perf_counter()
            store = fleet.log_dir / "adapter-store"
            outcome = asyncio.run(scenario(fleet, fixture, opts, store))
            walls["scenario"] = time.perf_counter() - t_scenario
            t_stop = time.perf_counter()
        walls["engine stop"] = time.perf_counter() - t_stop
    walls["demo total"] = time.perf_counter() - t_begin
    print_report(outcome, fleet, walls)
    report_path = fleet.log_dir / "demo-report.json"
    report_path.write_text(json.dumps(report_json(outcome, walls), indent=2) + "\n")
    failed = [name for ok, name, _ in outcome.checks if not ok]
    print(
        f"\n{len(outcome.checks) - len(failed)}/{len(outcome.checks)} checks passed; "
        f"report {report_path}; engines stopped"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
