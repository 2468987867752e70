"""What every chaos scenario shares: seeds, engine taps, agent load, a publication loop, the checks.

Nothing here replaces a part of the product. The engines are real SGLang processes, the registry,
Sessions, publisher, reclaimer and gateway are the shipped code; what this module adds sits at
the outer edges only:

* :class:`EngineTap` sits between the product and one engine and records every request the engine
  receives (a :class:`~tests.e2e.recording_proxy.TrafficLog`), so the verdicts ("no Session's
  requests reached two versions", "the restarted engine got no request for a version before it
  was loaded again") are read from what the engine side saw, not from what the client believes.
  A tap can also play its engine's death faithfully (:meth:`EngineTap.go_down`), see there.
* :class:`AgentLoad` runs the example tool-using agent (``examples/agents``) in concurrent loops,
  one Session per episode, over any :class:`SessionSource`: in-process Sessions
  (:class:`VersioningSource`) or the HTTP gateway (:class:`GatewaySource`). Every agent request
  carries ``rid = "<session id>-<12 hex>"`` (the agent's own request id), which is how the engine
  side tells Sessions apart (:func:`session_tag`).
* :class:`PublicationLoop` publishes fixture adapters A, B, C under fresh version ids every few
  seconds, whatever publishes them (a Deployment, the gateway's admin route).
* :class:`ServeProcess` runs ``agentic-lora serve`` as a child process that can be killed -9 and
  started again on the same journal and port.
* :func:`ledger_problems` and :func:`wire_problems` are the invariants checked after every fault.

Seeds. Every random choice of a scenario (which engine, which worker, after how many requests the
fault strikes) comes from :func:`scenario_rng`, seeded by :data:`SEED_ENV` (printed at the start
of the run; set it to replay a run's choices). Faults are triggered by counting requests at the
engine side, never by a wall-clock offset, and every wait is a bounded wait for an observable
event (:data:`GUARD_SECONDS`): no verdict depends on which of two things finished first.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from collections.abc import Awaitable
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Iterator
from collections.abc import Mapping
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any
from typing import Protocol
from typing import Self

import httpx
from agentic_lora_agent import TASKS
from agentic_lora_agent import AgentConfig
from agentic_lora_agent import AgentObserver
from agentic_lora_agent import AttemptOutcome
from agentic_lora_agent import AttemptRecord
from agentic_lora_agent import Episode
from agentic_lora_agent import ScriptedPolicy
from agentic_lora_agent import ToolAgent
from agentic_lora_agent import default_toolbox

from agentic_lora.engines.transport import EngineReply
from agentic_lora.engines.transport import Outcome
from agentic_lora.engines.transport import classify_exception
from agentic_lora.errors import AgenticLoRAError
from agentic_lora.errors import RequestIndeterminateError
from agentic_lora.errors import RequestRefusedError
from agentic_lora.errors import SessionReleaseError
from agentic_lora.errors import error_from_code
from agentic_lora.foundation.identity import VersionRef
from agentic_lora.registry.types import Binding
from agentic_lora.registry.types import EngineStatus
from agentic_lora.registry.types import LeaseStatus
from agentic_lora.registry.types import RegistryStatus
from agentic_lora.registry.types import VersionState
from agentic_lora.registry.types import VersionStatus
from agentic_lora.session import Versioning
from tests.e2e.recording_proxy import Exchange
from tests.e2e.recording_proxy import RecordingProxy
from tests.e2e.recording_proxy import TrafficLog
from tests.e2e.recording_proxy import Waiters
from tests.e2e.support import fleet_config

# Importable here through pytest's pythonpath (or bench's add_example_agents_to_path); a worker
# subprocess gets it on its PYTHONPATH.
_AGENTS = Path(__file__).resolve().parents[2] / "examples" / "agents"

__all__ = [
    "GENERATION_PATHS",
    "GUARD_SECONDS",
    "HOLDING_STATES",
    "SEED_ENV",
    "UNTAGGED",
    "AgentLoad",
    "EngineTap",
    "GatewaySource",
    "HttpSession",
    "Publication",
    "PublicationLoop",
    "ServeProcess",
    "SessionSource",
    "VersioningSource",
    "WorkerProcess",
    "adapter_of",
    "chaos_seed",
    "eventually",
    "is_generation",
    "ledger_problems",
    "load_config",
    "nth_generation",
    "scenario_rng",
    "served_before_loaded",
    "session_tag",
    "status_from_json",
    "versions_by_session",
    "wire_problems",
]

#: The environment variable that fixes the suite's seed (an integer). Unset: a fresh one, printed.
SEED_ENV = "AGENTIC_LORA_CHAOS_SEED"

#: The longest any step of a scenario may take before the run is called broken. A liveness guard
#: for waits on events the system must produce; never a measurement and never a race.
GUARD_SECONDS = 180.0

#: Routes that generate (what a Session sends an engine).
GENERATION_PATHS: frozenset[str] = frozenset(
    {"/generate", "/v1/chat/completions", "/v1/completions"}
)

#: Version states that hold a capacity slot.
HOLDING_STATES: frozenset[VersionState] = frozenset(s for s in VersionState if s.holds_slot)

now = time.monotonic
"""The one clock of a scenario (CLOCK_MONOTONIC: the same across processes on one machine)."""


# --- seeds --------------------------------------------------------------------------------------

_SEED: int | None = None


def chaos_seed() -> int:
    """The run's seed: :data:`SEED_ENV` if set, else a fresh one; printed once per process."""
    global _SEED
    if _SEED is None:
        raw = os.environ.get(SEED_ENV)
        _SEED = int(raw) if raw else secrets.randbelow(2**31)
        print(f"\nchaos seed: {_SEED} (replay with {SEED_ENV}={_SEED})", flush=True)
    return _SEED


def scenario_rng(name: str, seed: int | None = None) -> random.Random:
    """The random choices of scenario ``name``: the same for the same seed, whatever ran before."""
    return random.Random(f"{chaos_seed() if seed is None else seed}:{name}")


@contextlib.contextmanager
def local_ray_cluster(namespace: str) -> Iterator[None]:
    """A Ray cluster on this machine for one test module: two CPUs, no dashboard, and the
    workers' output kept out of the test's (their processes log to files of their own)."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, namespace=namespace, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


async def eventually(
    probe: Callable[[], Awaitable[Any]], *, what: str, limit: float = GUARD_SECONDS
) -> Any:
    """Poll ``probe`` (every 0.25 s) until it returns something truthy; AssertionError after
    ``limit`` seconds. For state that lives in another process, where there is no event to await."""
    deadline = now() + limit
    last: Any = None
    while True:
        last = await probe()
        if last:
            return last
        if now() > deadline:
            raise AssertionError(f"never happened within {limit:.0f} s: {what} (last: {last!r})")
        await asyncio.sleep(0.25)


# --- the engine side of the wire ----------------------------------------------------------------


class EngineTap(RecordingProxy):
    """A recording proxy in front of one engine that can also play that engine's death.

    Every request is forwarded once, unchanged, and recorded on ``log`` as an
    :class:`~tests.e2e.recording_proxy.Exchange` (see
    :class:`~tests.e2e.recording_proxy.RecordingProxy`).

    Faithful death. A killed engine refuses new connections (the client sees "connection refused":
    provably not sent) and drops the ones it had. A proxy that kept listening would turn that into
    an HTTP answer from a live socket and change how the product classifies the failure. So, right
    before the test kills the engine, :meth:`go_down` stops listening (new connections are refused
    by the kernel, as by the dead engine) and drops every client connection at once, idle or with a
    request in flight (that request is indeterminate for its caller, as with a killed engine: it
    may still run before the engine dies). :meth:`come_up` listens again on the same port once the
    engine is healthy, with a fresh upstream pool, and marks the log, so checks can tell requests
    the new engine incarnation received from the old one's. A request the tap forwarded but whose
    engine died under it is recorded with status 502.
    """

    def __init__(self, engine: str, upstream: str, log: TrafficLog) -> None:
        super().__init__(engine, upstream, log)
        #: Log sequence number of the moment each incarnation of the engine became reachable.
        self.up_marks: list[int] = []
        self._down = False

    @property
    def down(self) -> bool:
        return self._down

    async def start(self) -> Self:
        await super().start()
        self.up_marks.append(self.log.mark(f"{self.engine} up"))
        return self

    async def go_down(self) -> int:
        """Stop listening and drop idle connections (call right before killing the engine).

        Returns the log mark of the moment. No request can reach the engine through this tap
        after it, so requests the kill interrupts are exactly those already in flight.
        """
        assert self._runner is not None
        self._down = True
        if self._site is not None:
            await self._site.stop()
            self._site = None
        server = self._runner.server
        if server is not None:
            for handler in list(server.connections):
                # Every connection drops now, as the kernel drops a killed engine's sockets: an
                # idle keep-alive one must not linger half-open (a request written onto it would
                # wait for an answer until the client's timeout), and a request in flight loses
                # its answer (indeterminate: the engine may still run it before it dies).
                handler.force_close()
        return self.log.mark(f"{self.engine} down")

    async def come_up(self) -> int:
        """Listen again on the same port (call once the restarted engine is healthy)."""
        old, self._client = self._client, self._new_client()
        if old is not None:
            await old.close()
        self._down = False
        await self._listen()
        mark = self.log.mark(f"{self.engine} up")
        self.up_marks.append(mark)
        return mark


# --- reading the wire ---------------------------------------------------------------------------


def is_generation(exchange: Exchange) -> bool:
    return exchange.method == "POST" and exchange.path in GENERATION_PATHS


def adapter_of(exchange: Exchange) -> str | None:
    """The adapter a request names: ``lora_path`` / ``lora_name``, or the part of an OpenAI
    ``model`` after ``<base>:`` (how SGLang's OpenAI routes name an adapter)."""
    named = exchange.lora
    if named is not None:
        return named
    model = exchange.field("model")
    if isinstance(model, str) and ":" in model:
        return model.split(":", 1)[1]
    return None


def session_tag(exchange: Exchange) -> str | None:
    """The Session a generation belongs to, from its request id ``<session id>-<12 hex>``."""
    rid = exchange.field("rid")
    if not isinstance(rid, str) or "-" not in rid:
        return None
    return rid.rsplit("-", 1)[0]


#: The key of generations no Session sent (a publication's or repair's probe has no ``rid``).
UNTAGGED = "<no session>"


def versions_by_session(exchanges: Iterable[Exchange]) -> dict[str, set[str | None]]:
    """Every adapter the engines received per Session (generations only; probes, which carry no
    request id, under :data:`UNTAGGED`)."""
    seen: dict[str, set[str | None]] = {}
    for e in exchanges:
        if is_generation(e):
            seen.setdefault(session_tag(e) or UNTAGGED, set()).add(adapter_of(e))
    return seen


def _loaded_ok(e: Exchange) -> bool:
    return (
        e.path == "/load_lora_adapter"
        and e.status == 200
        and isinstance(e.reply, Mapping)
        and e.reply.get("success") is True
    )


def served_before_loaded(exchanges: Sequence[Exchange], engine: str, since: int) -> list[Exchange]:
    """Generations ``engine`` received after log mark ``since`` for an adapter that no successful
    load on it (answered before the generation was sent, after ``since``) had put there."""
    bad: list[Exchange] = []
    for g in exchanges:
        if g.engine != engine or g.seq_sent <= since or not is_generation(g):
            continue
        name = adapter_of(g)
        if not any(
            e.engine == engine
            and _loaded_ok(e)
            and e.lora == name
            and e.seq_sent > since
            and e.seq_done is not None
            and e.seq_done < g.seq_sent
            for e in exchanges
        ):
            bad.append(g)
    return bad


def wire_problems(taps: Mapping[str, EngineTap], traffic: TrafficLog) -> list[str]:
    """Invariants read from what the engines received, for the whole run so far.

    * every Session's generations named exactly one adapter, and none fell back to the base
      model (no adapter named);
    * each engine incarnation after the first received a generation for an adapter only after
      that adapter had been loaded onto that incarnation;
    * nothing paused, flushed or aborted an engine wholesale.
    """
    from tests.e2e.recording_proxy import forbidden_exchanges

    problems: list[str] = []
    exchanges = list(traffic.exchanges)
    for tag, names in sorted(versions_by_session(exchanges).items()):
        if tag == UNTAGGED:
            continue  # the publisher's and repairer's probes: no Session behind them
        if len(names) != 1 or None in names:
            problems.append(
                f"Session {tag} reached the engines with adapters {sorted(map(str, names))}"
            )
    for engine, tap in taps.items():
        for mark in tap.up_marks[1:]:
            for g in served_before_loaded(exchanges, engine, mark):
                problems.append(
                    f"{engine} received {adapter_of(g)} for Session {session_tag(g)} before that "
                    f"adapter was loaded onto its new incarnation: {g!r}"
                )
    problems += [f"forbidden engine call: {e!r}" for e in forbidden_exchanges(exchanges)]
    return problems


def nth_generation(
    traffic: TrafficLog,
    n: int,
    *,
    since: int = 0,
    engine: str | None = None,
    tag_prefix: str | None = None,
) -> Awaitable[Exchange]:
    """The ``n``-th generation (1-based) answered 200 after mark ``since`` (optionally on one
    engine, or of Sessions whose tag starts with ``tag_prefix``): a fault trigger that counts
    requests, not seconds."""
    counted: set[int] = set()

    def match(e: Exchange) -> bool:
        if not (
            e.done
            and e.status == 200
            and e.seq_sent > since
            and is_generation(e)
            and (engine is None or e.engine == engine)
            and (tag_prefix is None or (session_tag(e) or "").startswith(tag_prefix))
        ):
            return False
        counted.add(id(e))
        return len(counted) >= n

    return traffic.wait_for(match, what=f"generation #{n} (engine {engine}, tag {tag_prefix})")


# --- agents -------------------------------------------------------------------------------------


class SessionSource(Protocol):
    """Where agent Sessions come from: :meth:`open` one (no I/O), :meth:`close` it for good."""

    def open(self, session_id: str) -> Any: ...

    async def close(self, session: Any) -> None: ...


class VersioningSource:
    """In-process Sessions of one :class:`~agentic_lora.session.Versioning`."""

    def __init__(self, versioning: Versioning) -> None:
        self.versioning = versioning
        #: Registry key of every Session opened here, by Session id.
        self.keys: dict[str, str] = {}

    def open(self, session_id: str) -> Any:
        session = self.versioning.open_session(session_id)
        self.keys[session_id] = session.key
        return session

    def placed_on(self, session_id: str, engine: str) -> bool:
        """Whether the router's own choice for this Session (all engines healthy) is ``engine``."""
        key = self.keys.get(session_id)
        engines = tuple(e.name for e in self.versioning.engines)
        return key is not None and self.versioning.router.choose(key, engines, {}) == engine

    async def close(self, session: Any) -> None:
        deadline = now() + GUARD_SECONDS
        while True:
            try:
                await session.close()
                return
            except SessionReleaseError:
                # The release was not confirmed (the registry was unreachable): the Session stays
                # FINALIZING and close() replays it with the same request id.
                if now() > deadline:
                    raise
                await asyncio.sleep(0.25)


class HttpSession:
    """One gateway Session as the example agent sees a Session (duck-typed).

    ``chat_completions`` is one HTTP attempt to the gateway with ``X-Agentic-Session``; the
    gateway's typed errors come back as the same typed errors. A gateway that cannot be reached
    (connection refused: nothing was sent) is a :class:`RequestRefusedError` raised after a short
    pause, so an agent's bounded retries span a gateway restart; a connection lost after the
    request went out is :class:`RequestIndeterminateError`.
    """

    def __init__(self, session_id: str, client: httpx.AsyncClient, *, backoff: float) -> None:
        self.session_id = session_id
        self.key = session_id
        self.binding: Binding | None = None
        #: Every adapter the gateway said this Session used (the client's view; the engines'
        #: view is in the taps).
        self.lora_names: set[str] = set()
        self._client = client
        self._backoff = backoff

    async def chat_completions(self, body: Mapping[str, Any]) -> EngineReply:
        path = "/v1/chat/completions"
        try:
            response = await self._client.post(
                path, json=dict(body), headers={"x-agentic-session": self.session_id}
            )
        except httpx.TransportError as exc:
            if classify_exception(exc) is Outcome.REFUSED:
                await asyncio.sleep(self._backoff)
                raise RequestRefusedError(
                    f"gateway unreachable ({type(exc).__name__}); nothing was sent",
                    session=self.session_id,
                    stage="gateway",
                ) from exc
            raise RequestIndeterminateError(
                f"gateway connection lost after the request went out ({type(exc).__name__})",
                session=self.session_id,
                stage="gateway",
            ) from exc
        if response.status_code != 200:
            raise _typed_error(response)
        lora = response.headers.get("x-agentic-lora-name")
        version = response.headers.get("x-agentic-version")
        if lora and version:
            self.lora_names.add(lora)
            # The headers name the version and its lora_name, not its digest nor attempt.
            self.binding = Binding(self.session_id, VersionRef(version, "", lora, 0), 0)
        return EngineReply(
            engine=response.headers.get("x-agentic-engine", "?"),
            path=path,
            status_code=response.status_code,
            body=response.json(),
        )

    async def abort(self, rid: str) -> bool:
        return False  # the chaos agents are never interrupted

    def provenance(self) -> dict[str, Any] | None:
        return None  # the gateway's answer headers carry the version, not the lag


def _typed_error(response: httpx.Response) -> AgenticLoRAError:
    try:
        error = response.json().get("error")
    except ValueError:
        error = None
    if isinstance(error, Mapping) and isinstance(error.get("code"), str):
        details = error.get("details") if isinstance(error.get("details"), Mapping) else {}
        return error_from_code(error["code"], str(error.get("message", "")), **dict(details or {}))
    if response.status_code >= 500:
        return RequestIndeterminateError(
            f"gateway answered HTTP {response.status_code} without an error body",
            status=response.status_code,
        )
    return RequestRefusedError(
        f"gateway answered HTTP {response.status_code} without an error body",
        status=response.status_code,
    )


class GatewaySource:
    """Sessions of an ``agentic-lora serve`` gateway, named by the client (``X-Agentic-Session``).

    :meth:`close` asks the gateway to close the Session and, while the gateway is unreachable or
    restarting, asks again (a close is idempotent), bounded by :data:`GUARD_SECONDS`.
    """

    def __init__(self, base_url: str, *, backoff: float = 0.25) -> None:
        self.client = httpx.AsyncClient(
            base_url=base_url,
            timeout=httpx.Timeout(300.0, connect=5.0),
            trust_env=False,
            # Each attempt on a fresh connection: a pooled one to a killed gateway would turn
            # "refused" into "lost after sending".
            limits=httpx.Limits(max_keepalive_connections=0),
        )
        self._backoff = backoff
        #: Close answers per Session id (what the gateway said it released).
        self.closed: dict[str, Mapping[str, Any]] = {}

    def open(self, session_id: str) -> Any:
        return HttpSession(session_id, self.client, backoff=self._backoff)

    async def close(self, session: Any) -> None:
        path = f"/v1/sessions/{session.session_id}/close"
        deadline = now() + GUARD_SECONDS
        while True:
            try:
                response = await self.client.post(
                    path, headers={"x-agentic-session": session.session_id}
                )
                if response.status_code == 200:
                    self.closed[session.session_id] = response.json()
                    return
                if 400 <= response.status_code < 500:
                    self.closed[session.session_id] = {"status": response.status_code}
                    return
            except httpx.TransportError:
                pass
            if now() > deadline:
                raise AssertionError(f"the gateway never closed Session {session.session_id}")
            await asyncio.sleep(self._backoff)

    async def aclose(self) -> None:
        await self.client.aclose()


def load_config(*, max_retries: int = 2) -> AgentConfig:
    """The agents' budgets: short fixed-length turns (the tiny model's EOS would end them at random)."""
    return AgentConfig(
        max_turns=6,
        max_tokens=8,
        temperature=0.0,
        max_retries=max_retries,
        extra_body={"ignore_eos": True},
    )


class _Recorder(AgentObserver):
    def __init__(self, load: AgentLoad, index: int) -> None:
        self._load = load
        self._index = index

    async def before_turn(self, agent: ToolAgent, turn: int) -> None:
        load = self._load
        if turn and load.think:
            # A tool call's latency between turns: paces the load (it is not a synchronisation).
            await asyncio.sleep(load.think)
        binding = agent.session.binding
        if (
            turn
            and self._index in load.held_agents
            and not load.gate.is_set()
            and (
                load.held_on is None or (binding is not None and binding.version_id == load.held_on)
            )
        ):
            # Parked between two turns of a bound Session until the scenario releases it.
            load.parked[agent.session.session_id] = self._index
            load.parking.publish(agent.session.session_id)
            await load.gate.wait()

    def on_attempt(self, agent: ToolAgent, record: AttemptRecord) -> None:
        self._load.attempts.append(record)
        self._load.progress.publish(record)
        for listener in self._load.on_attempt:
            listener(record)


class AgentLoad:
    """``agents`` concurrent loops of the example agent, one Session per episode, until stopped.

    Session ids are ``<prefix>-a<agent>-e<episode>``. Each episode runs one task (scripted tool
    plan: the tiny model emits noise) and closes its Session however it ended. ``think`` seconds
    pass between an episode's turns, as a tool's latency would (on two cores, agents that never
    pause would starve a restarting engine of CPU and measure that instead of the recovery). Every attempt is
    kept (:attr:`attempts`, on the :func:`now` clock), every finished episode, and every error an
    agent loop caught.
    """

    def __init__(
        self,
        source: SessionSource,
        *,
        agents: int,
        prefix: str,
        config: AgentConfig | None = None,
        think: float = 0.25,
    ) -> None:
        self.source = source
        self.think = think
        self.agents = agents
        self.prefix = prefix
        self.config = config or load_config()
        self.attempts: list[AttemptRecord] = []
        self.episodes: list[Episode] = []
        self.errors: list[str] = []
        self.progress: Waiters[AttemptRecord] = Waiters()
        #: Session id -> when it opened, for Sessions not yet closed.
        self.live: dict[str, float] = {}
        #: Called with every attempt as it ends (e.g. a worker process reporting to the test).
        self.on_attempt: list[Callable[[AttemptRecord], None]] = []
        #: Agents that :meth:`hold` parks between two turns of a bound Session (see there).
        self.held_agents: frozenset[int] = frozenset()
        self.held_on: str | None = None
        self.gate = asyncio.Event()
        self.gate.set()
        #: Session id -> agent, for every Session that was parked at the gate.
        self.parked: dict[str, int] = {}
        self.parking: Waiters[str] = Waiters()
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._loop(i), name=f"{self.prefix} agent {i}")
            for i in range(self.agents)
        ]

    async def hold(self, agents: Iterable[int], *, on_version: str | None = None) -> set[str]:
        """Park ``agents`` before their next turn of an already bound Session (turn 1 or later;
        with ``on_version``, only a Session bound to that version) and return, once every one of
        them is parked, the ids of their parked Sessions.

        A scenario parks Sessions across a fault and a commit of a new default, then
        :meth:`release` s them: their next request is then one that a component that forgot their
        binding would send under the new default, so the wire check can catch it.
        """
        self.held_agents = frozenset(agents)
        self.held_on = on_version
        self.gate.clear()
        waiting = set(self.held_agents)
        found: set[str] = set()

        def parked(session_id: str) -> bool:
            agent = self.parked.get(session_id)
            if agent in waiting:
                waiting.discard(agent)
                found.add(session_id)
            return not waiting

        await self.parking.wait_for(parked, what=f"agents {sorted(self.held_agents)} parked")
        return found

    def release(self) -> None:
        """Let every parked agent go on."""
        self.gate.set()

    async def stop(self) -> None:
        """Let every agent finish its episode and close its Session (bounded)."""
        self._stop.set()
        if self._tasks:
            done, pending = await asyncio.wait(self._tasks, timeout=GUARD_SECONDS)
            for task in pending:
                task.cancel()
            for task in done:
                if task.exception() is not None:
                    self.errors.append(f"agent loop crashed: {task.exception()!r}")
            if pending:
                raise AssertionError(f"{len(pending)} agents did not finish their episodes")

    async def _loop(self, index: int) -> None:
        tasks = list(TASKS.values())
        tools = default_toolbox()
        policy = ScriptedPolicy()
        episode = 0
        while not self._stop.is_set():
            session_id = f"{self.prefix}-a{index}-e{episode}"
            task = tasks[(index + episode) % len(tasks)]
            session = self.source.open(session_id)
            self.live[session_id] = now()
            try:
                agent = ToolAgent(
                    session,
                    task,
                    tools=tools,
                    config=self.config,
                    policy=policy,
                    observer=_Recorder(self, index),
                    clock=now,
                )
                self.episodes.append(await agent.run())
            except Exception as exc:
                self.errors.append(f"{session_id}: {type(exc).__name__}: {exc}")
            finally:
                try:
                    await self.source.close(session)
                finally:
                    self.live.pop(session_id, None)
            episode += 1

    # --- reading what happened ------------------------------------------------------------------

    def failed(self, *, started_after: float = float("-inf")) -> list[AttemptRecord]:
        """Attempts that did not succeed (refused, indeterminate, failed), started after a time."""
        return [
            a
            for a in self.attempts
            if a.started_at > started_after and a.outcome is not AttemptOutcome.OK
        ]

    def first_ok_after(
        self, t: float, sessions: Callable[[str], bool] = lambda _: True
    ) -> AttemptRecord | None:
        """The earliest-ending successful attempt that started after ``t`` (of matching Sessions)."""
        ok = [
            a
            for a in self.attempts
            if a.outcome is AttemptOutcome.OK and a.started_at > t and sessions(a.session_id)
        ]
        return min(ok, key=lambda a: a.started_at + a.latency_s, default=None)

    async def wait_ok_after(
        self, t: float, sessions: Callable[[str], bool] = lambda _: True, *, what: str
    ) -> AttemptRecord:
        """The first successful attempt started after ``t`` (already made or future)."""
        return await self.progress.wait_for(
            lambda a: (
                a.outcome is AttemptOutcome.OK and a.started_at > t and sessions(a.session_id)
            ),
            what=what,
        )


# --- publications -------------------------------------------------------------------------------


@dataclass
class Publication:
    """One publish call of the loop, on the :func:`now` clock."""

    version_id: str
    letter: str
    start: float
    end: float | None = None
    outcome: str | None = None  # a PublicationOutcome value, when the call answered
    error: str | None = None  # the error code (or exception type) when it raised

    @property
    def ok(self) -> bool:
        return self.outcome == "PUBLISHED"


class PublicationLoop:
    """Publishes A, B, C, A, ... under fresh version ids until stopped.

    ``publish(version_id, letter)`` does one publication and returns its outcome value
    (``"PUBLISHED"``, ``"SKIPPED"``, ...) or raises. After an answer the loop waits ``interval``;
    after a failure (no answer, or not PUBLISHED) it tries again after ``retry_after``, so the
    first publication possible after a fault is not held back by the cadence.
    """

    def __init__(
        self,
        publish: Callable[[str, str], Awaitable[str]],
        *,
        tag: str,
        interval: float = 3.0,
        retry_after: float = 1.0,
        letters: Sequence[str] = ("A", "B", "C"),
    ) -> None:
        self._publish = publish
        self.tag = tag
        self.interval = interval
        self.retry_after = retry_after
        self.letters = tuple(letters)
        self.records: list[Publication] = []
        self.events: Waiters[Publication] = Waiters()
        self._stop = asyncio.Event()
        self._running = asyncio.Event()
        self._running.set()
        self._publishing = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._n = 0

    @property
    def next_index(self) -> int:
        """The number in the version id of the next publication (``<letter><n>-<tag>``)."""
        return self._n

    @property
    def committed(self) -> list[str]:
        """Version ids whose publish call answered PUBLISHED."""
        return [p.version_id for p in self.records if p.ok]

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name=f"publications {self.tag}")

    async def stop(self) -> None:
        self._stop.set()
        self._running.set()
        if self._task is not None:
            await asyncio.wait_for(self._task, GUARD_SECONDS)

    async def publish_once(self) -> Publication:
        """One publication now (the loop's next letter and id)."""
        letter = self.letters[self._n % len(self.letters)]
        record = Publication(f"{letter}{self._n}-{self.tag}", letter, now())
        self._n += 1
        self.records.append(record)
        try:
            record.outcome = await self._publish(record.version_id, letter)
        except AgenticLoRAError as exc:
            record.error = exc.code
        except Exception as exc:
            record.error = type(exc).__name__
        record.end = now()
        self.events.publish(record)
        return record

    async def pause(self) -> None:
        """Publish nothing more until :meth:`resume`; returns once a publication that was
        running has ended, so the default stays what it is now."""
        self._running.clear()
        async with self._publishing:
            pass

    def resume(self) -> None:
        self._running.set()

    async def _loop(self) -> None:
        while not self._stop.is_set():
            await self._running.wait()
            async with self._publishing:
                record = await self.publish_once()
            pause = self.interval if record.ok else self.retry_after
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), pause)

    async def wait_success_after(self, t: float, *, what: str) -> Publication:
        """The first publication that started after ``t`` and committed."""
        return await self.events.wait_for(lambda p: p.ok and p.start > t, what=what)


# --- the registry's ledger ----------------------------------------------------------------------


def status_from_json(raw: Mapping[str, Any]) -> RegistryStatus:
    """A :class:`RegistryStatus` from its JSON form (``GET /admin/status`` -> ``registry``)."""

    def version(v: Mapping[str, Any]) -> VersionStatus:
        values: dict[str, Any] = {k: tuple(x) if isinstance(x, list) else x for k, x in v.items()}
        values["state"] = VersionState(v["state"])
        return VersionStatus(**values)

    return RegistryStatus(
        deployment_epoch=raw["deployment_epoch"],
        capacity=raw["capacity"],
        engines=tuple(EngineStatus(**e) for e in raw["engines"]),
        default_version=raw["default_version"],
        default_revision=raw["default_revision"],
        slots_in_use=raw["slots_in_use"],
        pending_version=raw["pending_version"],
        versions=tuple(version(v) for v in raw["versions"]),
        live_sessions=raw.get("live_sessions", 0),
        leases=tuple(LeaseStatus(**x) for x in raw.get("leases", ())),
        named_sessions=raw.get("named_sessions", 0),
        rolled_back_from=raw.get("rolled_back_from"),
    )


def ledger_problems(status: RegistryStatus, committed: Iterable[str]) -> list[str]:
    """What the registry must still say after any fault.

    * every publication a caller saw committed is still there, with its commit (no commit lost);
    * the slots in use are exactly the versions in a slot-holding state, within capacity (no
      leaked slot, none counted twice);
    * the default is a PUBLISHED version.
    """
    problems: list[str] = []
    versions = {v.version_id: v for v in status.versions}
    for vid in committed:
        v = versions.get(vid)
        if v is None:
            problems.append(f"committed version {vid} is gone from the registry")
        elif v.published_revision is None or v.state in (
            VersionState.LOADING,
            VersionState.ABORTED,
            VersionState.FAILED_CLEAN,
        ):
            problems.append(f"committed version {vid} is {v.state.value}, uncommitted")
    holding = sum(1 for v in status.versions if v.state in HOLDING_STATES)
    if status.slots_in_use != holding:
        problems.append(
            f"slots in use {status.slots_in_use} != {holding} versions in a holding state"
        )
    if status.slots_in_use > status.capacity:
        problems.append(f"slots in use {status.slots_in_use} > capacity {status.capacity}")
    default = versions.get(status.default_version or "")
    if status.default_version is not None and (
        default is None or default.state is not VersionState.PUBLISHED
    ):
        problems.append(f"default {status.default_version} is not PUBLISHED")
    return problems


def settled(status: RegistryStatus) -> bool:
    """Nothing left in flight once the load stopped: no pending publication, nothing RETIRED,
    RECLAIMING or ABORTED, so the only slot in use is the default's."""
    unfinished = {
        VersionState.LOADING,
        VersionState.ABORTED,
        VersionState.RETIRED,
        VersionState.RECLAIMING,
    }
    return status.pending_version is None and not any(
        v.state in unfinished for v in status.versions
    )


# --- the gateway process ------------------------------------------------------------------------


@dataclass
class ServeProcess:
    """``agentic-lora serve`` as a child process: started, killed -9, started again.

    Every start uses the same config file, journal, port and adapter store, so a restart is the
    same gateway coming back. Its log (all incarnations, appended) is ``workdir/serve.log``.
    """

    workdir: Path
    engines: Mapping[str, str]
    base_model: str
    settings: Mapping[str, Any] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)
    port: int = 0
    admin_token: str = field(default_factory=lambda: uuid.uuid4().hex)
    process: subprocess.Popen[bytes] | None = None
    incarnation: int = 0

    def __post_init__(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        if not self.port:
            from agentic_lora_harness.engines import _free_port

            self.port = _free_port()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def journal(self) -> Path:
        return self.workdir / "registry.sqlite"

    @property
    def store_root(self) -> Path:
        return self.workdir / "adapter-store"

    @property
    def log_path(self) -> Path:
        return self.workdir / "serve.log"

    def _config(self) -> Path:
        path = self.workdir / "serve.json"
        config = {
            **fleet_config(self.engines, self.base_model),
            "journal_path": str(self.journal),
            "lora_name_prefix": "chaos_lora",
            **self.settings,
            "gateway": {"host": "127.0.0.1", "port": self.port},
            "backend_options": {"store_root": str(self.store_root)},
        }
        path.write_text(json.dumps(config, indent=2))
        (self.workdir / "admin-token").write_text(self.admin_token)
        return path

    def _spawn(self) -> subprocess.Popen[bytes]:
        config = self._config()
        self.incarnation += 1
        with self.log_path.open("ab") as log:
            log.write(f"\n=== serve incarnation {self.incarnation}\n".encode())
            log.flush()
            return subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    "import sys; from agentic_lora.cli import main; sys.exit(main())",
                    "serve",
                    "--config",
                    str(config),
                    "--admin-token-file",
                    str(self.workdir / "admin-token"),
                    "--log-format",
                    "json",
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env},
                start_new_session=True,
            )

    async def start(self) -> float:
        """Start an incarnation and wait until it serves; returns the seconds that took."""
        if self.process is not None and self.process.poll() is None:
            raise RuntimeError("serve is already running")
        started = now()
        self.process = self._spawn()
        async with httpx.AsyncClient(trust_env=False, timeout=2.0) as client:
            deadline = now() + GUARD_SECONDS
            while True:
                code = self.process.poll()
                if code is not None:
                    raise AssertionError(
                        f"serve exited with {code} before it served; log {self.log_path}:\n"
                        + self.log_tail()
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(f"{self.url}/health")).status_code == 200:
                        return now() - started
                if now() > deadline:
                    raise AssertionError(f"serve not serving after {GUARD_SECONDS:.0f} s")
                await asyncio.sleep(0.1)

    async def kill(self) -> None:
        """SIGKILL the whole process group (a crash: no Session is closed, nothing is flushed)."""
        await _kill(self.process)
        self.process = None

    async def stop(self) -> None:
        """SIGTERM (serve closes its Sessions and flushes the journal), SIGKILL after 60 s."""
        await _terminate(self.process, 60)
        self.process = None

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError as exc:
            return f"(no log: {exc})"

    def admin(self) -> Any:
        from agentic_lora.gateway.client import AdminClient

        return AdminClient(self.url, token=self.admin_token, timeout=10.0)


# --- rollout worker processes -------------------------------------------------------------------

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class WorkerProcess:
    """A rollout worker (``python -m tests.chaos.worker``) as a child process: started, killed -9,
    started again under the same owner id. It reports through an events file (see the worker
    module); every incarnation appends to the same one."""

    workdir: Path
    owner: str
    config: Mapping[str, Any]
    process: subprocess.Popen[bytes] | None = None

    @property
    def events_path(self) -> Path:
        return self.workdir / f"{self.owner}.events.jsonl"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"{self.owner}.log"

    def _spawn(self, lease_ttl: float) -> subprocess.Popen[bytes]:
        cfg = self.workdir / f"{self.owner}.json"
        cfg.write_text(
            json.dumps(
                {**self.config, "owner": self.owner, "lease_ttl": lease_ttl,
                 "events": str(self.events_path)}
            )
        )  # fmt: skip
        path = os.pathsep.join(
            [str(REPO_ROOT), str(_AGENTS), *filter(None, [os.environ.get("PYTHONPATH")])]
        )
        with self.log_path.open("ab") as log:
            return subprocess.Popen(
                [sys.executable, "-m", "tests.chaos.worker", str(cfg)],
                cwd=REPO_ROOT,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONPATH": path},
                start_new_session=True,
            )

    async def start(self, *, lease_ttl: float) -> dict[str, Any]:
        """Start an incarnation; returns its ``started`` event (incarnation, pid) once its agents
        run (bounded wait)."""
        if self.process is not None and self.process.poll() is None:
            raise RuntimeError(f"worker {self.owner} is already running")
        known = {e["incarnation"] for e in self.events() if e["kind"] == "started"}
        self.process = self._spawn(lease_ttl)
        deadline = now() + GUARD_SECONDS
        while True:
            fresh = [
                e for e in self.events() if e["kind"] == "started" and e["incarnation"] not in known
            ]
            if fresh:
                return fresh[0]
            code = self.process.poll()
            if code is not None or now() > deadline:
                raise AssertionError(
                    f"worker {self.owner} did not start (exit {code}); log {self.log_path}:\n"
                    + _tail(self.log_path)
                )
            # Another process writes the file: there is no event to await, only the file.
            await asyncio.sleep(0.1)

    def events(self) -> list[dict[str, Any]]:
        if not self.events_path.exists():
            return []
        out = []
        for line in self.events_path.read_text().splitlines():
            with contextlib.suppress(ValueError):  # a line cut by SIGKILL mid-write
                out.append(json.loads(line))
        return out

    def attempts(self, incarnation: str | None = None) -> list[dict[str, Any]]:
        tag = f"{self.owner}.{incarnation}-" if incarnation else f"{self.owner}."
        return [
            e for e in self.events() if e["kind"] == "attempt" and e["session_id"].startswith(tag)
        ]

    async def kill(self) -> None:
        await _kill(self.process)
        self.process = None

    async def stop(self) -> None:
        """SIGTERM: the worker closes its Sessions and its lease; SIGKILL after the guard."""
        stopped = await _terminate(self.process, GUARD_SECONDS)
        self.process = None
        if not stopped:
            raise AssertionError(f"worker {self.owner} did not stop on SIGTERM")


async def _kill(process: subprocess.Popen[bytes] | None) -> None:
    """SIGKILL ``process``'s whole group and reap it."""
    if process is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    await asyncio.to_thread(process.wait)


async def _terminate(process: subprocess.Popen[bytes] | None, grace: float) -> bool:
    """SIGTERM ``process`` and reap it; False when it outlived ``grace`` seconds (then killed)."""
    if process is None:
        return True
    with contextlib.suppress(ProcessLookupError):
        process.send_signal(signal.SIGTERM)
    try:
        await asyncio.to_thread(process.wait, grace)
    except subprocess.TimeoutExpired:
        await _kill(process)
        return False
    return True


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(no log: {exc})"


async def _listed_adapters(client: httpx.AsyncClient, base_url: str) -> set[str]:
    response = await client.get(f"{base_url}/v1/models")
    assert response.status_code == 200, response.text
    return {card["id"] for card in response.json()["data"] if card.get("parent") is not None}


@contextlib.asynccontextmanager
async def fleet_left_as_found(fleet: Any) -> AsyncIterator[None]:
    """Around one scenario on a shared fleet: afterwards every engine runs again and lists only
    adapters it listed before (an engine that was restarted lists less: it lost what it had).

    A scenario ends with its last default still loaded and pinned: left there, it would hold
    one of the engine's LoRA slots and the next scenario's publications would find the engine
    full, so every leftover is unloaded."""
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(300.0, connect=10.0), trust_env=False
    ) as client:
        before = {name: await _listed_adapters(client, url) for name, url in fleet.engines}
        yield
        for name in fleet.names:
            if fleet.pid(name) is None:  # a scenario that failed between kill and restart
                await fleet.arestart(name)
        for name, url in fleet.engines:
            for leftover in sorted(await _listed_adapters(client, url) - before[name]):
                response = await client.post(
                    f"{url}/unload_lora_adapter", json={"lora_name": leftover}
                )
                assert response.json()["success"] is True, response.text
        for name, url in fleet.engines:
            assert await _listed_adapters(client, url) <= before[name], name
