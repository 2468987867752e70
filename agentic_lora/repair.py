"""Engine repair: an engine that restarted gets back every version that may still be dispatched.

A new engine incarnation is a new process, and a new process holds no adapter. The registry voids
that engine's READY for every dispatchable version as soon as it observes the new incarnation
(:meth:`~agentic_lora.registry.core.RegistryCore.observe_incarnation`), so the dispatch chain
stops routing those versions there at once (``VersionStatus.ready_engines`` is the set of
holders). The :class:`Repairer` then puts them back::

    every probe_interval, and at once when poked (an engine refused a versioned dispatch):
        per engine: backend.incarnation -> observe_incarnation (only when it changed)
        per version PUBLISHED, or RETIRED with Session refs, lacking a probed engine:
            take the version's lock -> re-read it -> snapshot -> per lacking engine, concurrently:
                prepare (store, load pinned, probe) -> record_ready (committed attempt, the
                engine's current incarnation) -> the router may send the version there again

Rules, and what each one prevents:

* Only PUBLISHED versions and RETIRED versions that Sessions still hold are loaded again. A
  RETIRED version without refs belongs to the reclaimer (loading it would only delay its unload),
  a LOADING one to its publisher (whose incarnation check before commit already voids a READY
  from the old process), RECLAIMING/RECLAIMED ones to nobody: the registry counts a restart as
  their unload.
* Repair and reclaim of the same version never overlap: both take the version's lock in
  :class:`VersionLocks` (the reclaimer around its claim, a repair from its re-read to its
  record), so a claim waits for a running repair and a repair that starts after a claim sees
  RECLAIMING and does nothing. Without it a repair finishing after the reclaim's unload would
  leave the adapter loaded with nobody left to unload it.
* A READY that does not count (the version left the dispatchable states meanwhile, e.g. claimed
  by another process's reclaimer, which the lock cannot see: the registry takes the late READY
  without counting it, reported as ``INVALID_STATE``; or any refusal once the version is no
  longer dispatchable) means the copy just loaded must go: the repairer cleans it up
  (``backend.cleanup`` of the committed attempt). ``ENGINE_RESTARTED`` while the version is still dispatchable is *not*
  cleaned: the copy either died with the old process or sits, unrecorded and therefore never
  routed to, on the new one, where the next round's prepare finds it (HTTP push: already listed
  at its store path, so no second load) and records it. Cleaning it instead would fence the
  committed attempt in the backend (a cleaned attempt is never prepared again) and make the
  version unrepairable on that engine. A READY whose reply was lost is never cleaned: it may be
  recorded, and routed to.
* Repairs fit the engine's pinned slots by construction: every version repaired holds one of the
  registry's ``capacity`` slots, and start-up refuses engines whose ``max_loras_per_batch - 1``
  pinned slots are fewer than ``capacity``.
* The content comes from a :class:`SnapshotSource`: the Deployment's :class:`SnapshotCache` keeps
  what it published (evicted once the version is reclaimed) and falls back to the backend's
  immutable store (``stored_snapshot``, HTTP push and vLLM), so a restarted publisher can still
  repair. A version whose content cannot be had is reported (warning log, a progress event with
  ``error_code="SNAPSHOT_UNAVAILABLE"``, :attr:`Repairer.outcomes`) and retried every round; its
  Sessions keep going to the engines that hold it, or get ``VERSION_UNAVAILABLE``.

The probe also feeds routing and readiness: an engine whose incarnation cannot be read is marked
unhealthy in the given :class:`~agentic_lora.routing.EngineHealth` (so Sessions go to the other
holders while it is down) and healthy again once it answers; :meth:`Repairer.readiness` is false
once the registry fail-stopped or stopped answering, or while no engine answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from agentic_lora.adapter import AdapterSnapshot
from agentic_lora.backends import Backend, EngineRef, PublicationTarget
from agentic_lora.errors import (
    BackendRefusedError,
    ConfigurationError,
    EngineRestartedError,
    InvalidStateError,
    RegistryError,
    UnknownVersionError,
    error_code,
)
from agentic_lora.fleet import fixed_fleet
from agentic_lora.phases import Phase, PhaseEvent, PhaseRecorder, PhaseStatus
from agentic_lora.registry.api import RegistryAPI
from agentic_lora.registry.types import (
    RegistryStatus,
    VersionState,
    VersionStatus,
    new_request_id,
)
from agentic_lora.replay import RegistryRetry
from agentic_lora.routing import EngineHealth

__all__ = [
    "SNAPSHOT_UNAVAILABLE",
    "ProbeResult",
    "Readiness",
    "RepairOutcome",
    "RepairReport",
    "RepairResult",
    "Repairer",
    "SnapshotCache",
    "SnapshotSource",
    "StoredSnapshot",
    "VersionLocks",
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


# --- the lock repair and reclaim share ---------------------------------------------------------


class VersionLocks:
    """One asyncio lock per version id, shared by the :class:`Repairer` and the Reclaimer.

    A lock exists only while someone holds or waits for it, so memory follows the versions in
    use, not every version ever seen.
    """

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    def locked(self, version_id: str) -> bool:
        """Whether someone holds ``version_id``'s lock now."""
        entry = self._locks.get(version_id)
        return entry is not None and entry[0].locked()

    def contenders(self, version_id: str) -> int:
        """How many hold or wait for ``version_id``'s lock now."""
        entry = self._locks.get(version_id)
        return 0 if entry is None else entry[1]

    @contextlib.asynccontextmanager
    async def hold(self, version_id: str) -> AsyncIterator[None]:
        """Hold ``version_id``'s lock for the duration of the block."""
        lock, users = self._locks.get(version_id) or (asyncio.Lock(), 0)
        self._locks[version_id] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[version_id]
            if users == 1:
                del self._locks[version_id]
            else:
                self._locks[version_id] = (lock, users - 1)


# --- where a repair gets the version's content -------------------------------------------------


@runtime_checkable
class SnapshotSource(Protocol):
    """The content of a version, for loading it onto an engine again."""

    async def snapshot(self, version: VersionStatus) -> AdapterSnapshot:
        """``version``'s content (its digest is ``version.digest``); raise if it cannot be had."""
        ...


StoredSnapshot = Callable[[str, str], Awaitable[AdapterSnapshot | None]]
"""``await stored(lora_name, digest)``: the content a backend's immutable store holds under
``lora_name``, verified to hash to ``digest``, or None (e.g.
:meth:`~agentic_lora.adapter_backend.AdapterDirectoryBackend.stored_snapshot`)."""


class SnapshotCache:
    """A :class:`SnapshotSource` over the snapshots this process published, plus a fallback.

    An entry serves only a version with its digest, so content published under a conflicting id
    is never served for another version. :meth:`publishing` keeps an entry while its publication
    runs; :meth:`prune` (called by the repairer with every status it reads) drops entries whose
    version is RECLAIMED or FAILED_CLEAN, was never reserved, or names other content. Misses go
    to ``stored`` (a backend's immutable store), which is how a restarted publisher repairs.
    """

    def __init__(self, *, stored: StoredSnapshot | None = None) -> None:
        self._stored = stored
        self._entries: dict[str, AdapterSnapshot] = {}
        self._publishing: Counter[str] = Counter()
        # When each entry was last put or left its publication, on a counter (see prune).
        self._seq = 0
        self._touched: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, version_id: object) -> bool:
        return version_id in self._entries

    def put(self, version_id: str, snapshot: AdapterSnapshot) -> None:
        """Keep ``snapshot`` as ``version_id``'s content."""
        self._entries[version_id] = snapshot
        self._touch(version_id)

    def evict(self, version_id: str) -> bool:
        """Forget ``version_id`` (False if it was not cached)."""
        self._touched.pop(version_id, None)
        return self._entries.pop(version_id, None) is not None

    def mark(self) -> int:
        """A point to pass to :meth:`prune` as ``since``: take it before reading the status."""
        return self._seq

    def _touch(self, version_id: str) -> None:
        self._seq += 1
        self._touched[version_id] = self._seq

    @contextlib.contextmanager
    def publishing(self, version_id: str, snapshot: AdapterSnapshot) -> Iterator[None]:
        """Cache ``snapshot`` before its publication starts; :meth:`prune` spares it meanwhile.

        Put first: a restart observed right after the commit can be repaired at once.
        """
        self.put(version_id, snapshot)
        self._publishing[version_id] += 1
        try:
            yield
        finally:
            self._publishing[version_id] -= 1
            if self._publishing[version_id] <= 0:
                del self._publishing[version_id]
            if version_id in self._entries:
                self._touch(version_id)

    def prune(self, status: RegistryStatus, *, since: int | None = None) -> int:
        """Drop entries no repair can need any more (see class docstring); returns how many.

        ``since`` (a :meth:`mark` taken before ``status`` was read) spares every entry put, or
        whose publication ended, after it: the status may predate that publication's reserve.
        """
        known = {v.version_id: v for v in status.versions}
        drop = []
        for version_id, snapshot in self._entries.items():
            if version_id in self._publishing:
                continue
            if since is not None and self._touched.get(version_id, 0) > since:
                continue
            v = known.get(version_id)
            if (
                v is None
                or v.digest != snapshot.digest
                or v.state in (VersionState.RECLAIMED, VersionState.FAILED_CLEAN)
            ):
                drop.append(version_id)
        for version_id in drop:
            self.evict(version_id)
        return len(drop)

    async def snapshot(self, version: VersionStatus) -> AdapterSnapshot:
        """The cached content, else the stored one; BackendRefusedError if neither exists."""
        cached = self._entries.get(version.version_id)
        if cached is not None and cached.digest == version.digest:
            return cached
        if self._stored is not None:
            stored = await self._stored(version.lora_name, version.digest)
            if stored is not None:
                if stored.digest != version.digest:
                    raise BackendRefusedError(
                        f"the stored copy of {version.lora_name} hashes to {stored.digest[:16]}, "
                        f"not {version.digest[:16]}",
                        version=version.version_id,
                        reason="snapshot_mismatch",
                    )
                return stored
        raise BackendRefusedError(
            f"the content of {version.version_id} ({version.lora_name}) is neither cached nor "
            "stored; it cannot be loaded onto an engine again",
            version=version.version_id,
            reason="snapshot_unavailable",
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


# --- the repairer -------------------------------------------------------------------------------


class Repairer:
    """Loads dispatchable versions onto engines that lost them (see module docstring).

    ``health``: the Sessions' :class:`~agentic_lora.routing.EngineHealth`; an engine whose probe
    fails is marked unhealthy there until a probe succeeds again (only engines this repairer
    marked are marked healthy again, so an operator's mark stands). ``probe_timeout`` bounds one
    engine's incarnation read. ``clock`` feeds phase timings; ``monotonic`` readiness ages.
    """

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
        registry_retry: RegistryRetry | None = None,
        on_progress: Callable[[PhaseEvent], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        if not probe_interval > 0:
            raise ConfigurationError("probe_interval must be above 0", check="probe_interval")
        if not probe_timeout > 0:
            raise ConfigurationError("probe_timeout must be above 0", check="probe_timeout")
        self.registry = registry
        self.backend = backend
        self.engines: tuple[EngineRef, ...] = fixed_fleet(engines)
        self.snapshots = snapshots
        self.probe_interval = probe_interval
        self.probe_timeout = probe_timeout
        self.version_locks = version_locks if version_locks is not None else VersionLocks()
        self.health = health
        self.retry = registry_retry or RegistryRetry()
        self.on_progress = on_progress
        self._clock = clock
        self._monotonic = monotonic
        #: Every repair's outcome so far, counted (for metrics and tests).
        self.outcomes: Counter[RepairOutcome] = Counter()
        #: Rounds the background loop has finished.
        self.rounds = 0
        self._engine_ok: dict[str, bool] = {}
        self._marked_down: set[str] = set()
        self._status_at: float | None = None
        self._status_error: str | None = None
        self._poked_by: set[str] = set()
        self._unavailable: set[str] = set()  # versions whose missing content was reported
        self._repairs: dict[str, asyncio.Task[list[RepairResult]]] = {}
        self._wake = asyncio.Event()
        self._idle = asyncio.Condition()
        self._busy = False
        self._loop_task: asyncio.Task[None] | None = None

    # --- what it knows --------------------------------------------------------------------------

    @property
    def ready_engines(self) -> tuple[str, ...]:
        """Engines whose last probe succeeded, in fleet order."""
        return tuple(e.name for e in self.engines if self._engine_ok.get(e.name))

    def readiness(self, *, stale_after: float | None = None) -> Readiness:
        """Ready: the registry has not fail-stopped, answered a status read within
        ``stale_after`` seconds (default: three probe intervals), and some engine answered the
        last probe."""
        reasons: list[str] = []
        failed = getattr(self.registry, "failed", None)
        error: str | None = None
        if failed is not None:
            reasons.append("registry_failed")
            error = repr(failed)
        if getattr(self.registry, "closed", False) is True:
            reasons.append("registry_closed")
        limit = stale_after if stale_after is not None else 3 * self.probe_interval
        if self._status_at is None or self._monotonic() - self._status_at > limit:
            reasons.append("registry_unanswered")
            error = error or self._status_error
        if not self._engine_ok:
            reasons.append("not_probed")
        elif not any(self._engine_ok.values()):
            reasons.append("no_engine_ready")
        engines = {e.name: bool(self._engine_ok.get(e.name)) for e in self.engines}
        return Readiness(not reasons, tuple(reasons), engines, error)

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
        reads = await asyncio.gather(*(self._read_incarnation(e) for e in self.engines))
        incarnations = {e.name: inc for e, inc in zip(self.engines, reads, strict=True)}
        cache = self.snapshots if isinstance(self.snapshots, SnapshotCache) else None
        mark = cache.mark() if cache is not None else 0
        status = await self._status()
        if status is None:
            return ProbeResult(incarnations, None, frozenset(), ())
        self._check_fleet(status)
        known = {e.engine: e.incarnation for e in status.engines}
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

    # --- background -----------------------------------------------------------------------------

    def poke(self, engine: str | None = None) -> None:
        """Probe (and repair) now, not at the next tick; ``engine``: who looked restarted."""
        if engine is not None:
            self._poked_by.add(engine)
        self._wake.set()

    def start(self) -> None:
        """Probe at once, then every ``probe_interval`` and on every poke, until :meth:`stop`."""
        if self._loop_task is None or self._loop_task.done():
            self._wake.set()  # the start-up probe is pending: settled() waits for it
            self._loop_task = asyncio.get_running_loop().create_task(
                self._run(), name="lora-repairer"
            )

    async def stop(self) -> None:
        """Stop probing; a repair already loading finishes (its READY is recorded or cleaned)."""
        task, self._loop_task = self._loop_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for running in list(self._repairs.values()):
            with contextlib.suppress(Exception):
                await running

    async def settled(self) -> None:
        """Return once no poke is pending, no round runs and no repair is loading."""
        while True:
            async with self._idle:
                await self._idle.wait_for(lambda: not self._wake.is_set() and not self._busy)
            running = [t for t in self._repairs.values() if not t.done()]
            if not running:
                return
            await asyncio.wait(running)

    async def __aenter__(self) -> Repairer:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _run(self) -> None:
        while True:
            async with self._idle:
                # Cleared before the round: a poke during it triggers another round.
                self._wake.clear()
                self._busy = True
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
            finally:
                async with self._idle:
                    self._busy = False
                    self.rounds += 1
                    self._idle.notify_all()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.probe_interval)

    # --- the probe ------------------------------------------------------------------------------

    async def _read_incarnation(self, engine: EngineRef) -> str | None:
        try:
            async with asyncio.timeout(self.probe_timeout):
                incarnation = await self.backend.incarnation(engine)
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
            status = await self.registry.status()
        except Exception as exc:
            self._status_error = error_code(exc)
            logger.warning("registry status read failed", extra={"error_code": self._status_error})
            return None
        self._status_at = self._monotonic()
        self._status_error = None
        return status

    def _check_fleet(self, status: RegistryStatus) -> None:
        mine = sorted(e.name for e in self.engines)
        theirs = sorted(e.engine for e in status.engines)
        if mine != theirs:
            raise ConfigurationError(
                f"repairer fleet {mine} is not the registry's {theirs}",
                repairer=mine,
                registry=theirs,
            )

    async def _observe(self, engine: str, incarnation: str, *, first: bool) -> bool:
        request_id = new_request_id()
        recorder = PhaseRecorder(self._clock, self.on_progress)
        try:
            async with recorder.phase(engine, Phase.OBSERVE):
                await self.retry.call(
                    "observe_incarnation",
                    lambda: self.registry.observe_incarnation(
                        request_id=request_id, engine=engine, incarnation=incarnation
                    ),
                )
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
                if e not in v.ready_engines and probe.incarnations.get(e) is not None
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
            self._wake.set()

    async def _repair_version(
        self, version_id: str, engines: list[EngineRef]
    ) -> list[RepairResult]:
        recorder = PhaseRecorder(self._clock, self.on_progress, version_id)
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
            todo = [e for e in engines if e.name not in v.ready_engines]
            if not todo:
                return []
            try:
                snapshot = await self.snapshots.snapshot(v)
            except Exception as exc:
                return self._count(self._no_snapshot(v, todo, exc))
            self._unavailable.discard(version_id)
            target = PublicationTarget(v.version_id, v.digest, v.lora_name, v.attempt)
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
        extra = {"engine": engine.name, "version": target.version_id, "attempt": target.attempt}
        try:
            async with recorder.phase(engine.name, Phase.PREPARE):
                receipt = await self.backend.prepare(engine, target, snapshot)
        except Exception as exc:
            # Ambiguous or refused, the engine is not routed to for it (no READY): the next round
            # prepares again, and HTTP push adopts a copy that did get loaded without reloading.
            code = error_code(exc)
            logger.warning(
                "repair of %s failed on %s: %s", target.version_id, engine.name, exc, extra=extra
            )
            return RepairResult(target.version_id, engine.name, RepairOutcome.FAILED, code)
        request_id = new_request_id()
        try:
            async with recorder.phase(engine.name, Phase.RECORD_READY):
                status = await self.retry.call(
                    "record_ready",
                    lambda: self.registry.record_ready(request_id=request_id, receipt=receipt),
                )
        except RegistryError as exc:
            return await self._refused(recorder, engine, target, exc.code, exc)
        except Exception as exc:
            # The READY's fate is unknown: it may be recorded and routed to, so never clean it.
            code = error_code(exc)
            logger.warning(
                "repair READY of %s on %s unconfirmed", target.version_id, engine.name, extra=extra
            )
            return RepairResult(target.version_id, engine.name, RepairOutcome.FAILED, code)
        if engine.name not in status.ready_engines:
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
            # See the module docstring: the copy died with the old process or waits, unrouted, to
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
