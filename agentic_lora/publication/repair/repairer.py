"""The :class:`Repairer`: loads every dispatchable version back onto engines that lost it, each
probe interval and at once when poked (the rules are in :mod:`agentic_lora.publication.repair`)."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections import Counter
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Mapping
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field
from typing import Unpack

from agentic_lora.adapters.snapshot import AdapterSnapshot
from agentic_lora.engines.backends import Backend
from agentic_lora.engines.backends import EngineRef
from agentic_lora.engines.backends import PublicationTarget
from agentic_lora.engines.routing import EngineHealth
from agentic_lora.errors import BackendRefusedError
from agentic_lora.errors import ConfigurationError
from agentic_lora.errors import EngineRestartedError
from agentic_lora.errors import InvalidStateError
from agentic_lora.errors import RegistryError
from agentic_lora.errors import UnknownVersionError
from agentic_lora.errors import error_code
from agentic_lora.foundation.background import Rounds
from agentic_lora.foundation.phases import Phase
from agentic_lora.foundation.phases import PhaseEvent
from agentic_lora.foundation.phases import PhaseRecorder
from agentic_lora.foundation.phases import PhaseStatus
from agentic_lora.publication.ejection import Ejector
from agentic_lora.publication.loop import BackgroundLoop
from agentic_lora.publication.repair.locks import VersionLocks
from agentic_lora.publication.repair.probe import EngineProbe
from agentic_lora.publication.repair.probe import ProbeResult
from agentic_lora.publication.repair.probe import Readiness
from agentic_lora.publication.repair.snapshots import SnapshotCache
from agentic_lora.publication.repair.snapshots import SnapshotSource
from agentic_lora.publication.steps import FleetOptions
from agentic_lora.publication.steps import FleetWorker
from agentic_lora.publication.steps import attempt_extra
from agentic_lora.publication.steps import record_ready
from agentic_lora.registry.api import RegistryAPI
from agentic_lora.registry.types import VersionState
from agentic_lora.registry.types import VersionStatus

__all__ = [
    "SNAPSHOT_UNAVAILABLE",
    "RepairOutcome",
    "RepairReport",
    "RepairResult",
    "Repairer",
    "repairable",
]

logger = logging.getLogger(__name__)

#: The ``error_code`` of the progress event reporting a version whose content cannot be had.
SNAPSHOT_UNAVAILABLE = "SNAPSHOT_UNAVAILABLE"


def repairable(version: VersionStatus) -> bool:
    """Whether engines that lack ``version`` get it again: PUBLISHED, or RETIRED and still held."""
    return version.state is VersionState.PUBLISHED or (
        version.state is VersionState.RETIRED and version.session_refs > 0
    )


# --- results ------------------------------------------------------------------------------------


class RepairOutcome(enum.StrEnum):
    """How one repair of one version on one engine ended."""

    REPAIRED = "REPAIRED"  # loaded, probed, READY recorded: the router may send it there again
    FAILED = "FAILED"  # prepare failed, or the READY's fate is unknown: retried next round
    SNAPSHOT_UNAVAILABLE = "SNAPSHOT_UNAVAILABLE"  # no content to load: retried next round
    STALE = "STALE"  # READY refused: the engine restarted again, or the version left (cleaned)
    CLEANUP_UNCONFIRMED = "CLEANUP_UNCONFIRMED"  # READY refused and the copy's cleanup failed


@dataclass(frozen=True, slots=True)
class RepairResult:
    """One version on one engine."""

    version_id: str
    engine: str
    outcome: RepairOutcome
    error_code: str | None = None
    cleaned: bool | None = None  # after a refused READY: the copy was cleaned up (None: not tried)


@dataclass(frozen=True)
class RepairReport:
    """One round: what the probe read and what was repaired."""

    incarnations: Mapping[str, str | None] = field(default_factory=dict)  # None: unreadable
    restarted: tuple[str, ...] = ()  # engines whose new incarnation the registry learned now
    results: tuple[RepairResult, ...] = ()

    @property
    def repaired(self) -> tuple[tuple[str, str], ...]:
        """``(version_id, engine)`` pairs loaded and recorded again in this round."""
        return tuple(
            (r.version_id, r.engine) for r in self.results if r.outcome is RepairOutcome.REPAIRED
        )


# --- the repairer -------------------------------------------------------------------------------


class Repairer(FleetWorker, BackgroundLoop):
    """Loads dispatchable versions onto engines that lost them (see :mod:`agentic_lora.publication.repair`).

    ``health``: the Sessions' :class:`~agentic_lora.engines.routing.EngineHealth`; an engine whose probe
    fails is marked unhealthy there until a probe succeeds again (only engines this repairer
    marked are marked healthy again, so an operator's mark stands). ``probe_timeout`` bounds one
    engine's incarnation read. ``clock`` feeds phase timings; ``monotonic`` readiness ages. The
    probe and readiness are its :class:`~agentic_lora.publication.repair.probe.EngineProbe`'s.
    """

    role = "repairer"

    _loop_name = "lora-repairer"

    def __init__(
        self,
        registry: RegistryAPI,
        backend: Backend,
        engines: Sequence[EngineRef],
        *,
        snapshots: SnapshotSource,
        probe_interval: float = 2.0,
        probe_timeout: float = 5.0,
        version_locks: VersionLocks | None = None,
        health: EngineHealth | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        ejector: Ejector | None = None,
        **options: Unpack[FleetOptions],
    ) -> None:
        if not probe_interval > 0:
            raise ConfigurationError("probe_interval must be above 0", check="probe_interval")
        if not probe_timeout > 0:
            raise ConfigurationError("probe_timeout must be above 0", check="probe_timeout")
        super().__init__(registry, backend, engines, **options)
        self.snapshots = snapshots
        #: Told every probe round's reads: ejects engines that fail them, reactivates repaired
        #: ones (see agentic_lora.publication.ejection).
        self.ejector = ejector
        self.version_locks = version_locks if version_locks is not None else VersionLocks()
        #: Every repair's outcome so far, counted (for metrics and tests).
        self.outcomes: Counter[RepairOutcome] = Counter()
        self._probe = EngineProbe(
            self,
            probe_interval=probe_interval,
            probe_timeout=probe_timeout,
            health=health,
            monotonic=monotonic,
        )
        self._poked_by: set[str] = set()
        self._unavailable: set[str] = set()  # versions whose missing content was reported
        self._repairs: dict[str, asyncio.Task[list[RepairResult]]] = {}
        self._rounds = Rounds()

    # --- what it knows --------------------------------------------------------------------------

    @property
    def ready_engines(self) -> tuple[str, ...]:
        """Engines whose last probe succeeded, in fleet order."""
        return self._probe.ready_engines

    def readiness(self, *, stale_after: float | None = None) -> Readiness:
        """Ready: the registry has not fail-stopped, answered a status read within
        ``stale_after`` seconds (default: three probe intervals), and some engine answered the
        last probe."""
        return self._probe.readiness(stale_after=stale_after)

    # --- on demand ----------------------------------------------------------------------------

    async def repair_once(self) -> RepairReport:
        """Probe every engine, then repair what lacks a dispatchable version; wait for it all."""
        probe = await self.probe_once()
        tasks = self._schedule(probe)
        results: list[RepairResult] = []
        # Shielded: a caller that gives up must not cancel a load other callers wait on.
        for batch in await asyncio.gather(*(asyncio.shield(t) for t in tasks)):
            results.extend(batch)
        return RepairReport(dict(probe.incarnations), probe.restarted, tuple(results))

    async def probe_once(self) -> ProbeResult:
        """Read every engine's incarnation and tell the registry about the ones that changed."""
        cache = self.snapshots if isinstance(self.snapshots, SnapshotCache) else None
        if self.ejector is None:
            return await self._probe.probe_once(cache)
        started = self.ejector.round_started()
        probe = await self._probe.probe_once(cache)
        await self.ejector.observe(started, probe.incarnations, probe.status)
        return probe

    # --- background -----------------------------------------------------------------------------

    def poke(self, engine: str | None = None) -> None:
        """Probe (and repair) now, not at the next tick; ``engine``: who looked restarted."""
        if engine is not None:
            self._poked_by.add(engine)
        self._rounds.poke()

    def _starting(self) -> None:
        # Probe at once (settled() waits for it), then every probe_interval and on every poke.
        self._rounds.poke()

    def _finishing(self) -> Iterable[asyncio.Task[object]]:
        # stop(): a repair already loading finishes (its READY is recorded or cleaned).
        return self._repairs.values()

    async def settled(self) -> None:
        """Return once no poke is pending, no round runs and no repair is loading."""
        while True:
            await self._rounds.settled()
            running = [t for t in self._repairs.values() if not t.done()]
            if not running:
                return
            await asyncio.wait(running)

    async def _run(self) -> None:
        while True:
            async with self._rounds.round():
                poked, self._poked_by = self._poked_by, set()
                if poked:
                    logger.info(
                        "probing now: a dispatch was refused",
                        extra={"engines": sorted(poked)},
                    )
                try:
                    self._schedule(await self.probe_once())
                except Exception:
                    logger.exception("repair round failed; retried next interval")
            await self._rounds.wait(self._probe.probe_interval)

    # --- repairs --------------------------------------------------------------------------------

    def _schedule(self, probe: ProbeResult) -> list[asyncio.Task[list[RepairResult]]]:
        """One repair task per version that lacks a probed engine (joining one already running)."""
        if probe.status is None:
            return []
        by_name = {e.name: e for e in self.engines}
        tasks: list[asyncio.Task[list[RepairResult]]] = []
        for v in probe.status.versions:
            if not repairable(v):
                self._unavailable.discard(v.version_id)
                continue
            lacking = [
                by_name[e]
                for e in probe.observed
                if e not in v.held_engines and probe.incarnations.get(e) is not None
            ]
            if not lacking:
                self._unavailable.discard(v.version_id)
                continue
            task = self._repairs.get(v.version_id)
            if task is None:
                lacking.sort(key=lambda e: e.name)
                task = asyncio.get_running_loop().create_task(
                    self._repair_version(v.version_id, lacking),
                    name=f"repair {v.version_id}",
                )
                self._repairs[v.version_id] = task
                task.add_done_callback(self._repair_done)
            tasks.append(task)
        return tasks

    def _repair_done(self, task: asyncio.Task[list[RepairResult]]) -> None:
        for version_id, t in list(self._repairs.items()):
            if t is task:
                del self._repairs[version_id]
        if task.cancelled() or task.exception() is not None:
            return
        # Progress (or an engine that restarted again) warrants a fresh look at once; a failure
        # waits for the next tick, so a version that cannot be repaired is not retried in a loop.
        again = (RepairOutcome.REPAIRED, RepairOutcome.STALE)
        if any(r.outcome in again for r in task.result()):
            self._rounds.poke()

    async def _repair_version(
        self, version_id: str, engines: list[EngineRef]
    ) -> list[RepairResult]:
        recorder = self.recorder(version_id)
        async with self.version_locks.hold(version_id):
            # Re-read under the lock: a reclaim claimed meanwhile (RECLAIMING), a last Session gone
            # (RETIRED without refs), or another repair done, and there is nothing to do.
            try:
                v = await self.registry.version(version_id)
            except Exception as exc:
                code = error_code(exc)
                return self._count(
                    [RepairResult(version_id, e.name, RepairOutcome.FAILED, code) for e in engines]
                )
            if not repairable(v):
                return []
            todo = [e for e in engines if e.name not in v.held_engines]
            if not todo:
                return []
            try:
                snapshot = await self.snapshots.snapshot(v)
            except Exception as exc:
                return self._count(self._no_snapshot(v, todo, exc))
            self._unavailable.discard(version_id)
            target = v.ref
            results = await asyncio.gather(
                *(self._repair_on(recorder, e, target, snapshot) for e in todo)
            )
        return self._count(list(results))

    def _count(self, results: list[RepairResult]) -> list[RepairResult]:
        for r in results:
            self.outcomes[r.outcome] += 1
        return results

    def _no_snapshot(
        self, v: VersionStatus, engines: list[EngineRef], exc: Exception
    ) -> list[RepairResult]:
        names = [e.name for e in engines]
        if v.version_id not in self._unavailable:
            # Once per version until it is repaired or leaves: it is retried every round.
            self._unavailable.add(v.version_id)
            logger.warning(
                "cannot repair %s: its content is neither cached nor stored; its Sessions go to "
                "the engines that still hold it",
                v.version_id,
                extra={"version": v.version_id, "engines": names, "error": str(exc)},
            )
            if self.on_progress is not None:
                for name in names:
                    event = PhaseEvent(
                        name,
                        Phase.PREPARE,
                        PhaseStatus.FAILED,
                        0.0,
                        SNAPSHOT_UNAVAILABLE,
                        v.version_id,
                    )
                    try:
                        self.on_progress(event)
                    except Exception:
                        logger.exception("progress callback failed")
        return [
            RepairResult(v.version_id, n, RepairOutcome.SNAPSHOT_UNAVAILABLE, SNAPSHOT_UNAVAILABLE)
            for n in names
        ]

    async def _repair_on(
        self,
        recorder: PhaseRecorder,
        engine: EngineRef,
        target: PublicationTarget,
        snapshot: AdapterSnapshot,
    ) -> RepairResult:
        extra = attempt_extra(target, engine.name)
        try:
            receipt = await self._prepare_on(recorder, engine, target, snapshot)
        except Exception as exc:
            # Ambiguous or refused, the engine is not routed to for it (no READY): the next round
            # prepares again, and HTTP push adopts a copy that did get loaded without reloading.
            code = error_code(exc)
            logger.warning(
                "repair of %s failed on %s: %s", target.version_id, engine.name, exc, extra=extra
            )
            return RepairResult(target.version_id, engine.name, RepairOutcome.FAILED, code)
        try:
            status = await record_ready(self.registry, self.retry, recorder, receipt)
        except RegistryError as exc:
            return await self._refused(recorder, engine, target, exc.code, exc)
        except Exception as exc:
            # The READY's fate is unknown: it may be recorded and routed to, so never clean it.
            code = error_code(exc)
            logger.warning(
                "repair READY of %s on %s unconfirmed", target.version_id, engine.name, extra=extra
            )
            return RepairResult(target.version_id, engine.name, RepairOutcome.FAILED, code)
        if engine.name not in status.held_engines:
            # The registry takes a late READY of a committed attempt without counting it once the
            # version is on its way out (RECLAIMING/RECLAIMED): for this copy that is a refusal.
            return await self._refused(recorder, engine, target, InvalidStateError.code, None)
        logger.info("%s is on %s again", target.version_id, engine.name, extra=extra)
        return RepairResult(target.version_id, engine.name, RepairOutcome.REPAIRED)

    async def _refused(
        self,
        recorder: PhaseRecorder,
        engine: EngineRef,
        target: PublicationTarget,
        code: str,
        refusal: RegistryError | None,
    ) -> RepairResult:
        """The registry refused the repair's READY (or took it without counting it): clean the
        copy unless it may still count."""
        extra = {"engine": engine.name, "version": target.version_id, "error_code": code}
        try:
            now: VersionStatus | None = await self.registry.version(target.version_id)
        except UnknownVersionError:
            now = None
        except Exception:
            now = None  # unreadable: clean (an unrouted copy costs a reload; a stray one forever)
        dispatchable = now is not None and now.state.dispatchable and now.attempt == target.attempt
        if dispatchable and isinstance(refusal, EngineRestartedError):
            # See agentic_lora.publication.repair's docstring: the copy died with the old process or waits, unrouted, to
            # be recorded by the next round; cleaning it would fence the committed attempt.
            logger.warning(
                "engine restarted again during the repair of %s; repairing anew",
                target.version_id,
                extra=extra,
            )
            return RepairResult(
                target.version_id, engine.name, RepairOutcome.STALE, code, cleaned=None
            )
        logger.warning(
            "repair READY of %s on %s refused (%s); removing the loaded copy",
            target.version_id,
            engine.name,
            code,
            extra=extra,
        )
        try:
            async with recorder.phase(engine.name, Phase.CLEANUP):
                # A refusal means, by contract, that the engine holds nothing of this attempt.
                with contextlib.suppress(BackendRefusedError):
                    await self.backend.cleanup(engine, target)
        except Exception as exc:
            cleanup_code = error_code(exc)
            logger.error(
                "cleanup after a refused repair of %s on %s unconfirmed (%s)",
                target.version_id,
                engine.name,
                cleanup_code,
                extra=extra,
            )
            return RepairResult(
                target.version_id,
                engine.name,
                RepairOutcome.CLEANUP_UNCONFIRMED,
                code,
                cleaned=False,
            )
        return RepairResult(target.version_id, engine.name, RepairOutcome.STALE, code, cleaned=True)
