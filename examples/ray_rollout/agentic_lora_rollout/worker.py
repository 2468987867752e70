"""The rollout worker: a Ray actor that runs example-agent episodes on Sessions of the shared registry.

One worker is one OS process (a Ray actor). It holds one :class:`~agentic_lora.session.Versioning`
on the registry actor the driver created (looked up by name, never created here), built from the
settings the driver validated for it (:class:`WorkerConfig`), with an owner lease under the
worker's stable owner id (``owner_id``): if the process dies, its Sessions' refs come back when
the lease expires (``lease_ttl``) or at once when a worker with the same owner id starts again
(``on_restart="release"``). No publisher and no reclaimer live here: the driver publishes.

Each of ``agents`` loops runs episodes of the example agent (``agentic_lora_agent``), one Session
per episode, closed however the episode ended. The Session binds the default version at the
episode's first turn and carries that adapter on every later turn, whatever is published
meanwhile. Every finished episode is kept with its :meth:`~agentic_lora.session.Session.provenance`
(what a trainer stores with the trajectory).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field
from typing import Any

from agentic_lora_agent import AgentConfig
from agentic_lora_agent import AgentObserver
from agentic_lora_agent import AttemptOutcome
from agentic_lora_agent import AttemptRecord
from agentic_lora_agent import ScriptedPolicy
from agentic_lora_agent import ToolAgent
from agentic_lora_agent import default_toolbox
from agentic_lora_agent import episode_json
from agentic_lora_agent import task_for

from agentic_lora.config import AgenticLoRASettings
from agentic_lora.errors import ConfigurationError
from agentic_lora.errors import SessionReleaseError
from agentic_lora.registry.ray_actor import RayRegistryClient
from agentic_lora.session import Session
from agentic_lora.session import Versioning

__all__ = ["EpisodeLoop", "RolloutWorker", "WorkerConfig"]

#: How often a Session close whose release was not confirmed is replayed (same request id).
_CLOSE_ATTEMPTS = 20


@dataclass(frozen=True)
class WorkerConfig:
    """What one rollout worker needs (pickled to the actor's process, settings included).

    ``settings`` come validated from the driver
    (:func:`agentic_lora_rollout.driver.worker_settings`): the fleet the registry was created
    with, and this worker slot's ``owner_id``, ``lease_ttl`` and ``max_version_lag``. The worker
    builds its Versioning from them as they are; the other fields are the worker's own knobs.
    """

    #: The fleet's settings plus this slot's stable owner id (its owner lease, kept across
    #: restarts of the same slot), lease TTL and staleness bound.
    settings: AgenticLoRASettings
    registry_name: str
    namespace: str
    agents: int = 2
    #: Seconds between reads of the registry's status (the default revision behind each lag,
    #: and the dispatch guard's version cache).
    refresh_interval: float = 0.5
    max_turns: int = 6
    max_tokens: int = 8
    #: Sent with every request (SGLang's ``ignore_eos`` keeps turns at ``max_tokens``).
    extra_body: Mapping[str, Any] = field(default_factory=lambda: {"ignore_eos": True})

    def __post_init__(self) -> None:
        # Without a stable owner id a restarted slot could not release its predecessor's
        # Sessions; refuse here, in the driver, rather than in the actor's process.
        if self.settings.owner_id is None:
            raise ConfigurationError(
                "a rollout worker needs its slot's stable owner id (settings.owner_id)",
                check="owner_id",
            )

    @property
    def owner(self) -> str:
        """The worker slot's stable id (``settings.owner_id``)."""
        assert self.settings.owner_id is not None  # checked at construction
        return self.settings.owner_id


class _Observer(AgentObserver):
    def __init__(self, loop: EpisodeLoop) -> None:
        self._loop = loop

    async def before_turn(self, agent: ToolAgent, turn: int) -> None:
        loop = self._loop
        session = agent.session
        if turn and not loop.gate.is_set() and session.binding is not None:
            # Parked between two turns of a bound Session until release(): whatever commits
            # meanwhile, the next request of this Session must still carry its own version.
            loop.parked[session.session_id] = {
                "session": session.session_id,
                "key": session.key,
                "version": session.binding.version_id,
                "lora_name": session.binding.lora_name,
            }
            loop.changed.set()
            await loop.gate.wait()

    def on_attempt(self, agent: ToolAgent, record: AttemptRecord) -> None:
        loop = self._loop
        loop.attempts.append(record)
        if record.outcome is AttemptOutcome.OK:
            loop.answered += 1
        loop.changed.set()


class EpisodeLoop:
    """``agents`` concurrent loops of example-agent episodes on one Versioning, until stopped.

    Session ids are ``<tag>-a<agent>-e<episode>``; the agent's request ids are
    ``<session id>-<12 hex>``, so an engine-side recording tells Sessions apart.
    """

    def __init__(self, versioning: Versioning, *, agents: int, tag: str, config: AgentConfig):
        self.versioning = versioning
        self.tag = tag
        self.config = config
        self.episodes: list[dict[str, Any]] = []
        self.attempts: list[AttemptRecord] = []
        self.errors: list[str] = []
        self.answered = 0
        #: Session id -> its registry key and bound version, for every Session :meth:`hold` parked.
        self.parked: dict[str, dict[str, str]] = {}
        self.gate = asyncio.Event()
        self.gate.set()
        #: Set on every attempt, park and episode end; waiters clear it and re-check.
        self.changed = asyncio.Event()
        self._agents = agents
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [
            asyncio.get_running_loop().create_task(self._run(i), name=f"{self.tag} agent {i}")
            for i in range(self._agents)
        ]

    async def until(self, done: Any) -> None:
        """Wait until ``done()`` holds (re-checked after every attempt, park and episode)."""
        while not done():
            self.changed.clear()
            if any(t.done() for t in self._tasks):
                raise RuntimeError(f"an agent loop of {self.tag} ended: {self.errors}")
            await self.changed.wait()

    async def hold(self) -> list[dict[str, str]]:
        """Park every agent before its next turn of a bound Session; returns, once all are
        parked, each parked Session's id, registry key, bound version id and adapter name."""
        self.parked.clear()
        self.gate.clear()
        await self.until(lambda: len(self.parked) >= self._agents)
        return list(self.parked.values())

    def release(self) -> None:
        self.gate.set()

    async def stop(self) -> None:
        """Let every agent finish its episode and close its Session."""
        self._stop.set()
        self.gate.set()
        results = await asyncio.gather(*self._tasks, return_exceptions=True)
        self.errors += [f"agent loop crashed: {r!r}" for r in results if isinstance(r, Exception)]

    async def _run(self, index: int) -> None:
        tools = default_toolbox()
        episode = 0
        while not self._stop.is_set():
            session = self.versioning.open_session(f"{self.tag}-a{index}-e{episode}")
            try:
                agent = ToolAgent(
                    session,
                    task_for(index, episode),
                    tools=tools,
                    config=self.config,
                    policy=ScriptedPolicy(),  # the tiny test model emits no parsable call
                    observer=_Observer(self),
                )
                self.episodes.append(episode_json(await agent.run()))
            except Exception as exc:
                self.errors.append(f"{session.session_id}: {type(exc).__name__}: {exc}")
            finally:
                await _close(session)
                self.changed.set()
            episode += 1


async def _close(session: Session) -> None:
    for attempt in range(_CLOSE_ATTEMPTS):
        try:
            await session.close()
            return
        except SessionReleaseError:
            # Not confirmed (the registry actor was away): the Session stays FINALIZING and
            # close() replays the release with the same request id.
            if attempt + 1 == _CLOSE_ATTEMPTS:
                raise
            await asyncio.sleep(0.25)


class RolloutWorker:
    """The actor body (spawned with ``ray.remote`` by :func:`agentic_lora_rollout.spawn_worker`).

    Methods are coroutines: an async actor runs them on one event loop beside the agents.
    """

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        #: A fresh id per process: tells this incarnation's Sessions from a predecessor's.
        self.incarnation = uuid.uuid4().hex[:6]
        self._registry: RayRegistryClient | None = None
        self._versioning: Versioning | None = None
        self._loop: EpisodeLoop | None = None

    async def start(self) -> dict[str, Any]:
        """Open the owner lease, start the agents; returns who this incarnation is.

        The lease is opened here, before any Session binds, so a predecessor of the same
        ``owner`` has its Sessions released by the time this returns (``released``).
        """
        import ray

        cfg = self.config
        self._registry = registry = RayRegistryClient(
            ray.get_actor(cfg.registry_name, namespace=cfg.namespace)
        )
        self._versioning = versioning = Versioning.from_settings(cfg.settings, registry=registry)
        await registry.refresh()
        registry.start_refresh(cfg.refresh_interval)
        released: list[str] = []
        keeper = versioning.lease
        if keeper is not None:
            keeper.listeners.append(lambda e: released.extend(e.released))
            await keeper.acquire()
        self._loop = EpisodeLoop(
            versioning,
            agents=cfg.agents,
            tag=f"{cfg.owner}.{self.incarnation}",
            config=AgentConfig(
                max_turns=cfg.max_turns,
                max_tokens=cfg.max_tokens,
                temperature=0.0,
                extra_body=dict(cfg.extra_body),
            ),
        )
        self._loop.start()
        return {
            "owner": cfg.owner,
            "incarnation": self.incarnation,
            "pid": os.getpid(),
            "lease_id": keeper.current.lease_id if keeper is not None else None,
            "released": released,
        }

    def _episodes(self) -> EpisodeLoop:
        if self._loop is None:
            raise RuntimeError("the worker has not started")
        return self._loop

    async def wait_answered(self, turns: int) -> int:
        """Return once this worker's agents got ``turns`` answered generations in all."""
        loop = self._episodes()
        await loop.until(lambda: loop.answered >= turns)
        return loop.answered

    async def wait_answered_on(self, lora_name: str, turns: int = 1) -> int:
        """Return once ``turns`` generations carrying ``lora_name`` were answered here."""
        loop = self._episodes()

        def on_it() -> int:
            return sum(
                1
                for a in loop.attempts
                if a.outcome is AttemptOutcome.OK and a.lora_name == lora_name
            )

        await loop.until(lambda: on_it() >= turns)
        return on_it()

    async def wait_episodes(self, count: int) -> int:
        """Return once ``count`` episodes ended here."""
        loop = self._episodes()
        await loop.until(lambda: len(loop.episodes) >= count)
        return len(loop.episodes)

    async def hold(self) -> list[dict[str, str]]:
        """Park every agent between two turns of its bound Session (see EpisodeLoop.hold)."""
        return await self._episodes().hold()

    async def wait_for_sessions(self, session_ids: list[str]) -> list[dict[str, Any]]:
        """Return the episodes of these Sessions once every one of them ended here."""
        loop = self._episodes()
        wanted = set(session_ids)

        def ended() -> list[dict[str, Any]]:
            return [ep for ep in loop.episodes if ep["session"] in wanted]

        await loop.until(lambda: len(ended()) >= len(wanted))
        return ended()

    async def release(self) -> None:
        self._episodes().release()

    async def sync_revision(self) -> int | None:
        """Read the registry's status now; returns the default revision this worker sees."""
        assert self._registry is not None
        await self._registry.refresh()
        return self._registry.default_revision()

    async def pid(self) -> int:
        return os.getpid()

    async def stop(self) -> dict[str, Any]:
        """Finish the running episodes, close every Session and the lease; returns every
        episode (with its provenance) and every error an agent loop caught."""
        loop = self._episodes()
        await loop.stop()
        if self._versioning is not None:
            await self._versioning.aclose()
        if self._registry is not None:
            with contextlib.suppress(Exception):
                await self._registry.stop_refresh()
        return {"episodes": list(loop.episodes), "errors": list(loop.errors)}
