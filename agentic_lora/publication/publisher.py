"""Publication: get one version onto every engine, then make it the default, or leave no trace.

::

    reserve ──> per engine, concurrently: prepare (reads the incarnation) -> record_ready
                      │ all READY                                   │ any engine failed
                      v                                             v
        observe every incarnation -> commit             abort -> per engine: cleanup -> confirm_cleanup
                      │                                             │ all confirmed   │ some unconfirmed
                      v                                             v                 v
                  PUBLISHED                                    FAILED_CLEAN         BLOCKED

Rules this module keeps, and what each one prevents:

* ``reserve`` comes first and admits capacity before any byte moves: a refused version costs no
  engine call. After the bootstrap version a capacity refusal is a SKIPPED result (the run goes on
  with the current default); for the very first version any failure is fatal (raised).
* Every engine's prepare runs to its own end and is collected as an outcome; one engine failing
  never cancels another's in-flight load into an unknown state.
* Each engine's incarnation is observed again right before ``commit``: an engine that restarted
  since its READY invalidates it in the registry, so ``commit`` refuses and the attempt is cleaned.
* Registry calls carry request ids. A lost reply (any error that is not a typed registry answer)
  is replayed with the same id, so a commit whose reply was lost is retried, never doubled. If a
  commit's outcome stays unknown the candidate is never cleaned: the result is BLOCKED.
* Cleanup runs on every engine whatever its prepare did; the slot is freed (FAILED_CLEAN) only when
  every engine confirmed. Anything unconfirmed keeps the slot and blocks later publications
  (BLOCKED) until :meth:`Publisher.resolve` finishes the cleanup. A BLOCKED result, or a
  publication that ended without a result (cancelled, crashed) with its version still LOADING,
  pokes the attached :attr:`Publisher.resolver` (see :mod:`agentic_lora.publication.resolver`), which calls
  :meth:`Publisher.resolve` in the background until every engine confirmed.
* ``resolve`` holds the same lock as ``publish``: it never aborts or cleans a version while this
  process is still publishing it. It observes each unconfirmed engine's incarnation before any
  cleanup call: a restarted engine holds nothing, and the registry counts that as its cleanup.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from collections.abc import Callable
from collections.abc import Coroutine
from collections.abc import Sequence
from typing import Any
from typing import Protocol
from typing import Unpack

from agentic_lora.adapters.snapshot import AdapterSnapshot
from agentic_lora.engines.backends import Backend
from agentic_lora.engines.backends import EngineRef
from agentic_lora.errors import AgenticLoRAError
from agentic_lora.errors import BackendAmbiguousError
from agentic_lora.errors import BackendRefusedError
from agentic_lora.errors import CapacityError
from agentic_lora.errors import EngineRestartedError
from agentic_lora.errors import RegistryError
from agentic_lora.errors import error_code
from agentic_lora.foundation.phases import Phase
from agentic_lora.foundation.phases import PhaseEvent
from agentic_lora.foundation.phases import PhaseRecorder
from agentic_lora.foundation.phases import PhaseStatus
from agentic_lora.foundation.phases import PhaseTiming
from agentic_lora.foundation.replay import RegistryRetry
from agentic_lora.publication.cleanup import CleanupSteps
from agentic_lora.publication.ejection import ENGINE_EJECTED
from agentic_lora.publication.ejection import Ejections
from agentic_lora.publication.ejection import unless_ejected
from agentic_lora.publication.result import EngineReport
from agentic_lora.publication.result import PublicationOutcome
from agentic_lora.publication.result import PublicationResult
from agentic_lora.publication.result import PublicationRun
from agentic_lora.publication.steps import FleetOptions
from agentic_lora.publication.steps import attempt_extra
from agentic_lora.publication.steps import attempt_of
from agentic_lora.publication.steps import record_ready
from agentic_lora.publication.steps import registry_step
from agentic_lora.registry.api import RegistryAPI
from agentic_lora.registry.types import CommitReceipt
from agentic_lora.registry.types import ReadyReceipt
from agentic_lora.registry.types import Reservation
from agentic_lora.registry.types import ReserveOutcome
from agentic_lora.registry.types import VersionState

# Phase types, RegistryRetry and the result types live in agentic_lora.foundation.phases, agentic_lora.foundation.replay
# and agentic_lora.publication.result; they stay importable from here for callers written before
# they moved.
__all__ = [
    "EngineReport",
    "Phase",
    "PhaseEvent",
    "PhaseRecorder",
    "PhaseStatus",
    "PhaseTiming",
    "PublicationOutcome",
    "PublicationResult",
    "Publisher",
    "ReclaimTrigger",
    "RegistryRetry",
    "ResolveTrigger",
]

logger = logging.getLogger(__name__)


class ReclaimTrigger(Protocol):
    """The part of a reclaimer the publisher uses (see :class:`agentic_lora.publication.reclaimer.Reclaimer`)."""

    def poke(self) -> None: ...

    async def reclaim_once(self) -> object: ...


class ResolveTrigger(Protocol):
    """The part of a resolver the publisher uses (see :class:`agentic_lora.publication.resolver.Resolver`)."""

    def poke(self) -> None: ...


class Publisher(CleanupSteps):
    """Publishes versions through ``backend`` onto the fixed fleet ``engines`` (one at a time).

    ``reclaimer`` (optional) is poked after every commit and asked for one reclaim round when a
    reservation hits capacity. ``resolver`` (optional; a :class:`~agentic_lora.publication.resolver.Resolver`
    sets itself here) is poked whenever a publication leaves its version unresolved.
    ``on_progress`` receives a :class:`PhaseEvent` per phase start and end (for a CLI). ``clock``
    only feeds the timings.
    """

    role = "publisher"

    def __init__(
        self,
        registry: RegistryAPI,
        backend: Backend,
        engines: Sequence[EngineRef],
        *,
        reclaimer: ReclaimTrigger | None = None,
        ejections: Ejections | None = None,
        **options: Unpack[FleetOptions],
    ) -> None:
        super().__init__(registry, backend, engines, **options)
        self.reclaimer = reclaimer
        #: Engines ejected while a publication waits on them: it stops waiting (see ejection).
        self.ejections = ejections
        self.resolver: ResolveTrigger | None = None
        self._lock = asyncio.Lock()
        #: Versions a publication of this process left unresolved (BLOCKED, or ended without a
        #: result while LOADING). Only this process's publisher can know that nobody is still
        #: publishing them, so the resolver aborts a LOADING version only if it is listed here.
        self.abandoned: set[str] = set()

    @property
    def busy(self) -> bool:
        """A publication or a resolve holds the publisher right now."""
        return self._lock.locked()

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        """Hold the publisher: a publication, rollback or resolve of this process running now
        ends first, and none starts until the block ends. A membership change uses it for its
        last step (an engine's activation, a drained engine's removal), so no publication's
        set of engines changes under it (see :meth:`agentic_lora.assembly.deployment.Deployment.add_engine`)."""
        async with self._lock:
            yield

    # --- public verbs -------------------------------------------------------------------------

    async def publish(self, version_id: str, snapshot: AdapterSnapshot) -> PublicationResult:
        """Publish ``snapshot`` as ``version_id`` and make it the default (see module docstring).

        Raises typed registry errors for bad requests (VERSION_CONFLICT, PUBLICATION_BLOCKED, ...)
        and, for the bootstrap version, any failure. Returns a result otherwise.
        """
        async with self._lock:
            status = await self.registry.status()
            run = PublicationRun(
                version_id,
                snapshot.digest,
                bootstrap=status.default_version is None,
                recorder=self.recorder(version_id),
            )
            reservation = await self._reserve(run)
            if reservation is None:
                return run.result(PublicationOutcome.SKIPPED, reason=CapacityError.code)
            run.target = reservation.ref
            # A fleet mismatch is for a human: the resolver could not clean that fleet either.
            run.members = self.members_of(reservation.engines)
            if reservation.outcome is ReserveOutcome.ALREADY_COMPLETED:
                # Same id, same content, committed before: nothing to load, nothing to switch.
                return run.result(PublicationOutcome.ALREADY_PUBLISHED)
            try:
                result = await self._prepare_and_commit(run, snapshot, status.default_revision)
            except BaseException:
                # Cancelled or crashed with the version reserved: it may stay LOADING, holding
                # its slot and blocking every later publication, unless it is resolved.
                self._left_unresolved(version_id)
                raise
            if result.outcome is PublicationOutcome.BLOCKED:
                self._left_unresolved(version_id)
            return self._final(run, result)

    async def resolve(
        self, version_id: str, *, reason: str = "resolved by operator"
    ) -> PublicationResult:
        """Finish a publication left LOADING or ABORTED (a crash, a BLOCKED result).

        Waits for a publication of this process to end first. A LOADING version is then aborted
        (``reason`` is recorded with the abort). For every engine that has not confirmed cleanup,
        its incarnation is observed first (a restart is proof of cleanup; no call is made), then
        its cleanup is run; the slot is freed only when all have confirmed. A version in any
        other state is left alone (its result says so: "nothing to resolve").
        """
        async with self._lock:
            status = await self.registry.version(version_id)
            run = PublicationRun.of(status, self.recorder(version_id))
            if status.state not in (VersionState.LOADING, VersionState.ABORTED):
                self.abandoned.discard(version_id)
                return run.result(
                    PublicationOutcome.FAILED_CLEAN
                    if status.state is VersionState.FAILED_CLEAN
                    else PublicationOutcome.ALREADY_PUBLISHED,
                    reason=f"nothing to resolve: {status.state.value}",
                )
            result = await self._abort_and_clean(
                run, reason=reason, skip=set(status.cleaned_engines), observe_first=True
            )
            if result.outcome is not PublicationOutcome.BLOCKED:
                self.abandoned.discard(version_id)
            return result

    def _left_unresolved(self, version_id: str) -> None:
        self.abandoned.add(version_id)
        if self.resolver is not None:
            self.resolver.poke()

    # --- steps --------------------------------------------------------------------------------

    async def _reserve(self, run: PublicationRun, *, reload: bool = False) -> Reservation | None:
        """The reservation, or None when capacity refused it even after one reclaim round.
        ``reload``: a rollback's (``reserve_rollback``), not a publication's (``reserve``)."""

        async def reserve(rid: str) -> Reservation:
            if reload:
                return await self.registry.reserve_rollback(
                    request_id=rid, version_id=run.version_id
                )
            return await self.registry.reserve(
                request_id=rid, version_id=run.version_id, digest=run.digest
            )

        phase = Phase.RESERVE_ROLLBACK if reload else Phase.RESERVE

        async def step() -> Reservation:
            return await registry_step(run.recorder, None, phase, self.retry, reserve)

        try:
            return await step()
        except CapacityError as exc:
            if self.reclaimer is None:
                await self._skip(run, exc)
                return None
        # Capacity is full: one reclaim round may free a retired version's slot.
        await self.reclaimer.reclaim_once()
        try:
            return await step()
        except CapacityError as exc:
            await self._skip(run, exc)
            return None

    async def _skip(self, run: PublicationRun, exc: CapacityError) -> None:
        if run.bootstrap:
            raise exc
        logger.warning(
            "publication of %s skipped: no free version slot; the current default stays",
            run.version_id,
            extra={"version": run.version_id},
        )
        # A refusal by an in-process registry suspends nowhere. Yield once, or a caller that
        # publishes in a loop starves the very Sessions and reclaimer that would free a slot:
        # a livelock, every publication skipped and nothing else running.
        await asyncio.sleep(0)

    async def _prepare_and_commit(
        self,
        run: PublicationRun,
        snapshot: AdapterSnapshot,
        revision: int,
    ) -> PublicationResult:
        members = run.members or self.engines
        reports = await self._each_member(lambda e: self._prepare_one(run, e, snapshot), members)
        run.reports.update({r.engine: r for r in reports})
        failed = [r for r in reports if not r.ready]
        if failed:
            reason = "; ".join(f"{r.engine}: {r.error_code}" for r in failed)
            return await self._abort_and_clean(run, reason=f"prepare failed ({reason})")
        # Right before commit: an engine that restarted since its READY must not count.
        restarted = await self._each_member(lambda e: self._observe(run, e), members)
        unreadable = [r for r in restarted if r.error_code not in (None, ENGINE_EJECTED)]
        if unreadable:
            for r in unreadable:
                run.reports[r.engine] = r
            names = ", ".join(r.engine for r in unreadable)
            return await self._abort_and_clean(
                run, reason=f"incarnation unknown before commit ({names})"
            )
        return await self._commit(run, revision)

    def members_of(self, names: Sequence[str]) -> tuple[EngineRef, ...]:
        """This publisher's engines among the registry's ``names`` (a reservation's ACTIVE
        members), in fleet order; a name it does not know is a deployment mistake."""
        mine = {e.name for e in self.engines}
        if not set(names) <= mine:
            self.check_fleet(names)  # raises ConfigurationError naming both fleets
        return tuple(e for e in self.engines if e.name in names)

    async def _each_member(
        self,
        work: Callable[[EngineRef], Coroutine[Any, Any, EngineReport]],
        members: Sequence[EngineRef],
    ) -> list[EngineReport]:
        """``work`` on each member; one ejected meanwhile stops being waited for (its report:
        ready, ``error_code=ENGINE_EJECTED``): the registry no longer counts it for readiness."""

        async def guarded(engine: EngineRef) -> EngineReport:
            def ejected() -> EngineReport:
                logger.warning(
                    "engine ejected; the publication goes on over the live members",
                    extra={"engine": engine.name},
                )
                return EngineReport(engine.name, ready=True, error_code=ENGINE_EJECTED)

            return await unless_ejected(self.ejections, engine.name, work(engine), ejected)

        return await self._each_engine(guarded, members)

    async def _prepare_one(
        self, run: PublicationRun, engine: EngineRef, snapshot: AdapterSnapshot
    ) -> EngineReport:
        target = run.attempt
        extra = attempt_extra(target, engine.name)
        try:
            receipt = await self._prepare_on(run.recorder, engine, target, snapshot)
            await self._record_ready(run, engine, receipt)
        except Exception as exc:
            # Collected, not propagated: the other engines' prepares run to their own end.
            code = error_code(exc)
            logger.warning("prepare failed on %s: %s", engine.name, exc, extra=extra)
            return EngineReport(engine.name, ready=False, error_code=code, error=str(exc))
        logger.info("READY on %s", engine.name, extra=extra)
        return EngineReport(engine.name, ready=True)

    async def _record_ready(
        self, run: PublicationRun, engine: EngineRef, receipt: ReadyReceipt
    ) -> None:
        """Record ``receipt``, the incarnation it carries read by the prepare right before its
        load (no separate read before the prepare).

        Refused ENGINE_RESTARTED, either the engine restarted after that read (the registry
        already holds the newer process: the receipt is void) or it restarted before it and
        nothing has observed the new process yet (the registry holds the old one). A fresh read
        tells them apart: it is observed, and the READY recorded again only if the receipt's
        incarnation is the one the engine has now.
        """
        try:
            await record_ready(self.registry, self.retry, run.recorder, receipt)
        except EngineRestartedError:
            if await self._observe_or_raise(run, engine) != receipt.incarnation:
                raise
            await record_ready(self.registry, self.retry, run.recorder, receipt)

    async def _observe(self, run: PublicationRun, engine: EngineRef) -> EngineReport:
        try:
            await self._observe_or_raise(run, engine, recheck=True)
        except Exception as exc:
            code = error_code(exc)
            return EngineReport(engine.name, ready=True, error_code=code, error=str(exc))
        return EngineReport(engine.name, ready=True)

    async def _commit(self, run: PublicationRun, revision: int) -> PublicationResult:
        target = run.attempt
        extra = attempt_extra(target)

        async def commit(rid: str) -> CommitReceipt:
            return await self.registry.commit(
                request_id=rid, expected_default_revision=revision, **attempt_of(target)
            )

        try:
            receipt = await registry_step(run.recorder, None, Phase.COMMIT, self.retry, commit)
        except RegistryError as exc:
            # A definite refusal (an engine restarted, the default moved): nothing was switched.
            return await self._abort_and_clean(run, reason=f"commit refused: {exc.code}")
        except Exception as exc:
            # Unknown: the commit may have happened. Cleaning B now could unload the default.
            logger.error("commit of %s unconfirmed: %r", target.version_id, exc, extra=extra)
            return run.result(
                PublicationOutcome.BLOCKED,
                reason=f"commit unconfirmed ({type(exc).__name__}); the resolver settles it, "
                "or publish the same version again",
            )
        logger.info(
            "%s is the default (revision %d)",
            target.version_id,
            receipt.default_revision,
            extra=extra,
        )
        if self.reclaimer is not None:
            self.reclaimer.poke()
        return run.result(PublicationOutcome.PUBLISHED, commit=receipt)

    def _final(self, run: PublicationRun, result: PublicationResult) -> PublicationResult:
        if run.bootstrap and not result.ok:
            # The very first version failed: there is nothing to fall back to.
            error_cls: type[AgenticLoRAError] = (
                BackendRefusedError
                if result.outcome is PublicationOutcome.FAILED_CLEAN
                else BackendAmbiguousError
            )
            raise error_cls(
                f"bootstrap publication of {run.version_id} failed: {result.reason}",
                version=run.version_id,
                outcome=result.outcome.value,
                result=result,
            )
        return result
