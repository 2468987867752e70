"""The engine probe: every engine's incarnation read, a new one told to the registry, engines that
do not answer marked unhealthy for routing, and the readiness that follows (see
:mod:`agentic_lora.publication.repair`)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from collections.abc import Mapping
from dataclasses import KW_ONLY
from dataclasses import dataclass
from dataclasses import field

from agentic_lora.engines.backends import EngineRef
from agentic_lora.engines.routing import EngineHealth
from agentic_lora.errors import error_code
from agentic_lora.foundation.phases import Phase
from agentic_lora.publication.repair.snapshots import SnapshotCache
from agentic_lora.publication.steps import FleetWorker
from agentic_lora.publication.steps import registry_step
from agentic_lora.registry.types import RegistryStatus

__all__ = ["EngineProbe", "ProbeResult", "Readiness"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Readiness:
    """Whether this process can serve generations (the gateway's ``/health/ready``).

    ``reasons`` are stable strings: ``registry_failed`` (the journal fail-stopped),
    ``registry_closed``, ``registry_unanswered`` (no successful status read within
    ``stale_after`` seconds, or none yet), ``no_engine_ready`` (no engine answered the last
    probe), ``not_probed`` (no probe finished yet).
    """

    ready: bool
    reasons: tuple[str, ...]
    engines: Mapping[str, bool]
    registry_error: str | None = None


@dataclass(frozen=True)
class ProbeResult:
    """What one probe read: every engine's incarnation and the registry's status after it."""

    incarnations: dict[str, str | None]
    status: RegistryStatus | None
    observed: frozenset[str]  # engines whose read incarnation is the registry's current one
    restarted: tuple[str, ...]


@dataclass(eq=False)
class EngineProbe:
    """Reads every engine's incarnation for a :class:`~agentic_lora.publication.repair.Repairer` and keeps
    what follows from it: which engines answer, the registry's last status read, readiness.

    ``health``: the Sessions' :class:`~agentic_lora.engines.routing.EngineHealth`; an engine whose probe
    fails is marked unhealthy there until a probe succeeds again (only engines this probe marked
    are marked healthy again, so an operator's mark stands). ``probe_timeout`` bounds one
    engine's incarnation read. Phase timings are the worker's; ``monotonic`` ages readiness.
    """

    #: The repairer it probes for: its registry, backend, fleet, registry retry and progress.
    worker: FleetWorker
    _: KW_ONLY
    probe_interval: float
    probe_timeout: float
    health: EngineHealth | None
    monotonic: Callable[[], float] = time.monotonic
    _engine_ok: dict[str, bool] = field(init=False, default_factory=dict)
    _marked_down: set[str] = field(init=False, default_factory=set)
    _status_at: float | None = field(init=False, default=None)
    _status_error: str | None = field(init=False, default=None)

    # --- what it knows --------------------------------------------------------------------------

    @property
    def ready_engines(self) -> tuple[str, ...]:
        """Engines whose last probe succeeded, in fleet order."""
        return tuple(e.name for e in self.worker.engines if self._engine_ok.get(e.name))

    def readiness(self, *, stale_after: float | None = None) -> Readiness:
        """Ready: the registry has not fail-stopped, answered a status read within
        ``stale_after`` seconds (default: three probe intervals), and some engine answered the
        last probe."""
        reasons: list[str] = []
        failed = getattr(self.worker.registry, "failed", None)
        error: str | None = None
        if failed is not None:
            reasons.append("registry_failed")
            error = repr(failed)
        if getattr(self.worker.registry, "closed", False) is True:
            reasons.append("registry_closed")
        limit = stale_after if stale_after is not None else 3 * self.probe_interval
        if self._status_at is None or self.monotonic() - self._status_at > limit:
            reasons.append("registry_unanswered")
            error = error or self._status_error
        if not self._engine_ok:
            reasons.append("not_probed")
        elif not any(self._engine_ok.values()):
            reasons.append("no_engine_ready")
        engines = {e.name: bool(self._engine_ok.get(e.name)) for e in self.worker.engines}
        return Readiness(not reasons, tuple(reasons), engines, error)

    async def probe_once(self, cache: SnapshotCache | None = None) -> ProbeResult:
        """Read every engine's incarnation and tell the registry about the ones that changed.

        ``cache`` is pruned with the status read (its mark is taken before the read)."""
        reads = await asyncio.gather(*(self._read_incarnation(e) for e in self.worker.engines))
        incarnations = {e.name: inc for e, inc in zip(self.worker.engines, reads, strict=True)}
        mark = cache.mark() if cache is not None else 0
        status = await self._status()
        if status is None:
            return ProbeResult(incarnations, None, frozenset(), ())
        self.worker.check_fleet(e.engine for e in status.engines)
        known = {e.engine: e.incarnation for e in status.engines}
        # An engine removed from the registry's fleet is probed for nothing.
        incarnations = {e: inc for e, inc in incarnations.items() if e in known}
        observed = {e for e, inc in incarnations.items() if inc is not None and known[e] == inc}
        changed = [
            (e, inc) for e, inc in incarnations.items() if inc is not None and e not in observed
        ]
        restarted: list[str] = []
        for engine, inc in changed:
            # Only on a change: an unchanged incarnation is not worth a journal row per tick.
            if await self._observe(engine, inc, first=known[engine] is None):
                observed.add(engine)
                if known[engine] is not None:
                    restarted.append(engine)
        if changed:
            status = await self._status() or status
        for engine in observed:
            self._route_again(engine)
        if cache is not None:
            cache.prune(status, since=mark)
        return ProbeResult(incarnations, status, frozenset(observed), tuple(restarted))

    # --- the probe ------------------------------------------------------------------------------

    async def _read_incarnation(self, engine: EngineRef) -> str | None:
        try:
            async with asyncio.timeout(self.probe_timeout):
                incarnation = await self.worker.backend.incarnation(engine)
        except Exception as exc:
            self._engine_down(engine.name, exc)
            return None
        self._engine_answers(engine.name)
        return incarnation

    def _engine_down(self, engine: str, exc: BaseException) -> None:
        was_ok = self._engine_ok.get(engine, True)
        self._engine_ok[engine] = False
        code = error_code(exc)
        if was_ok:
            logger.warning(
                "engine does not answer its incarnation probe; not ready",
                extra={"engine": engine, "error_code": code},
            )
        if self.health is not None and self.health.is_healthy(engine):
            self.health.mark_unhealthy(engine)
            self._marked_down.add(engine)

    def _engine_answers(self, engine: str) -> None:
        if self._engine_ok.get(engine) is False:
            logger.info("engine answers its incarnation probe again", extra={"engine": engine})
        self._engine_ok[engine] = True

    def _route_again(self, engine: str) -> None:
        # Only once the registry holds the engine's current incarnation: an engine that came back
        # as a new process must have been dropped from every version's holders before it is
        # routed to again, or a Session's request would reach it for a version it lacks.
        if self.health is not None and engine in self._marked_down:
            self._marked_down.discard(engine)
            self.health.mark_healthy(engine)

    async def _status(self) -> RegistryStatus | None:
        try:
            status = await self.worker.registry.status()
        except Exception as exc:
            self._status_error = error_code(exc)
            logger.warning("registry status read failed", extra={"error_code": self._status_error})
            return None
        self._status_at = self.monotonic()
        self._status_error = None
        return status

    async def _observe(self, engine: str, incarnation: str, *, first: bool) -> bool:
        recorder = self.worker.recorder()

        async def observe(rid: str) -> bool:
            return await self.worker.registry.observe_incarnation(
                request_id=rid, engine=engine, incarnation=incarnation
            )

        try:
            await registry_step(recorder, engine, Phase.OBSERVE, self.worker.retry, observe)
        except Exception as exc:
            code = error_code(exc)
            logger.warning(
                "could not record a new engine incarnation",
                extra={"engine": engine, "incarnation": incarnation, "error_code": code},
            )
            return False
        if not first:
            logger.warning(
                "engine restarted: its versions are loaded onto it again before it is routed to",
                extra={"engine": engine, "incarnation": incarnation},
            )
        return True
