"""Reclaim: unload a retired version from every engine once no Session can ask for it again.

::

    RETIRED, 0 Session refs --claim_reclaim--> RECLAIMING (stable reclaim id; dispatch refused)
        per engine not yet confirmed, concurrently: backend.reclaim -> confirm_reclaim
        every engine confirmed --> RECLAIMED (slot freed)

Two owners decide when a version may go, and neither is duplicated here: the registry's Session
refs say when reclaim may *start* (no Session bound to it), the engine's native request refcount
says when the physical unload may *happen* (the backend's unload waits for it).

* The claim is idempotent and carries a stable reclaim id, so a retried round resumes the same
  reclaim and skips engines the registry already counts as confirmed.
* One reclaim per version runs at a time in this process; a second request joins it, so an engine
  is never asked twice concurrently.
* The claim is taken under the version's lock in :attr:`Reclaimer.version_locks`, which the
  :class:`~agentic_lora.publication.repair.Repairer` holds while it loads a version onto a restarted engine:
  a claim waits for a running repair (whose copy the unloads then remove), and a repair that
  starts after the claim finds RECLAIMING and loads nothing.
* An engine whose unload is not confirmed keeps the slot held (the version stays RECLAIMING) and is
  retried by a later round; a retry after a lost receipt finds the name absent, which confirms it
  without a second physical unload.

:meth:`Reclaimer.reclaim_once` runs one round on demand, over every eligible version.
:meth:`Reclaimer.start` runs rounds in the background, each woken by :meth:`Reclaimer.poke` (after a
commit, after a Session release) or by a version's retry falling due:

* A version whose last round left an engine unconfirmed is retried after a backoff (1 s, 2 s,
  4 s ... 30 s by default), not on the next poke. Under agent load a Session release pokes many
  times a second; without the backoff every one of them sent another unload to an engine that is
  down (and logged it), for as long as the engine stayed down. A poke still reclaims a version
  that became eligible since at once. An engine that comes back as a new process confirms the
  unload by its restart (the registry counts it), so the backoff never delays a freed slot past
  the next round.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Iterable
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Unpack

from tenacity.wait import wait_base

from agentic_lora.engines.backends import Backend
from agentic_lora.engines.backends import EngineRef
from agentic_lora.errors import SessionStillBoundError
from agentic_lora.errors import error_code
from agentic_lora.foundation.background import Rounds
from agentic_lora.foundation.background import backoff as default_backoff
from agentic_lora.foundation.background import delay_after
from agentic_lora.foundation.phases import Phase
from agentic_lora.foundation.phases import PhaseRecorder
from agentic_lora.foundation.phases import PhaseTiming
from agentic_lora.publication.ejection import ENGINE_EJECTED
from agentic_lora.publication.ejection import Ejections
from agentic_lora.publication.ejection import unless_ejected
from agentic_lora.publication.loop import BackgroundLoop
from agentic_lora.publication.repair import VersionLocks
from agentic_lora.publication.steps import FleetOptions
from agentic_lora.publication.steps import FleetWorker
from agentic_lora.publication.steps import registry_step
from agentic_lora.registry.api import RegistryAPI
from agentic_lora.registry.types import ReclaimClaim
from agentic_lora.registry.types import VersionState
from agentic_lora.registry.types import VersionStatus
from agentic_lora.registry.types import new_request_id

__all__ = ["ReclaimOutcome", "ReclaimReport", "ReclaimResult", "Reclaimer"]

logger = logging.getLogger(__name__)


class ReclaimOutcome(enum.StrEnum):
    RECLAIMED = "RECLAIMED"  # every engine confirmed; slot freed
    PENDING = "PENDING"  # claimed, some engine unconfirmed; slot held, retried later
    STILL_BOUND = "STILL_BOUND"  # a Session holds it again; not claimed


@dataclass(frozen=True)
class ReclaimResult:
    """One version's reclaim round."""

    version_id: str
    outcome: ReclaimOutcome
    lora_name: str | None = None
    reclaim_id: str | None = None
    confirmed: tuple[str, ...] = ()
    unconfirmed: tuple[str, ...] = ()
    errors: tuple[tuple[str, str], ...] = ()  # (engine, or "registry" for the claim; error code)
    timings: tuple[PhaseTiming, ...] = ()


@dataclass(frozen=True)
class ReclaimReport:
    """One round over every eligible version."""

    results: tuple[ReclaimResult, ...] = ()

    @property
    def reclaimed(self) -> tuple[str, ...]:
        return tuple(r.version_id for r in self.results if r.outcome is ReclaimOutcome.RECLAIMED)

    @property
    def pending(self) -> tuple[str, ...]:
        return tuple(r.version_id for r in self.results if r.outcome is ReclaimOutcome.PENDING)


class Reclaimer(FleetWorker, BackgroundLoop):
    """Reclaims retired versions through ``backend`` on the fixed fleet ``engines``."""

    role = "reclaimer"

    _loop_name = "agentic-lora reclaimer"

    def __init__(
        self,
        registry: RegistryAPI,
        backend: Backend,
        engines: Sequence[EngineRef],
        *,
        backoff: wait_base | None = None,
        version_locks: VersionLocks | None = None,
        ejections: Ejections | None = None,
        **options: Unpack[FleetOptions],
    ) -> None:
        super().__init__(registry, backend, engines, **options)
        #: Engines ejected for failed probes: their unloads are not waited for (see above).
        self.ejections = ejections
        #: Wait before the background loop retries a version left unconfirmed (per version).
        self.backoff = backoff if backoff is not None else default_backoff()
        #: Shared with the Repairer: a claim never overlaps a repair of the same version.
        self.version_locks = version_locks if version_locks is not None else VersionLocks()
        self._inflight: dict[str, asyncio.Task[ReclaimResult]] = {}
        self._rounds = Rounds()
        # version -> (unconfirmed rounds in a row, clock() before which the loop does not retry)
        self._retry_at: dict[str, tuple[int, float]] = {}

    # --- on demand ---------------------------------------------------------------------------

    async def reclaim_once(self) -> ReclaimReport:
        """Reclaim every RETIRED version without Session refs, and resume RECLAIMING ones."""
        return await self._round(due_only=False)

    async def _round(self, *, due_only: bool) -> ReclaimReport:
        status = await self.registry.status()
        eligible = [
            v.version_id
            for v in status.versions
            if v.state is VersionState.RECLAIMING
            or (v.state is VersionState.RETIRED and v.session_refs == 0)
        ]
        for gone in set(self._retry_at) - set(eligible):
            del self._retry_at[gone]  # reclaimed (by a restart, another process) or bound again
        if due_only:
            now = self._clock()
            eligible = [v for v in eligible if self._retry_at.get(v, (0, now))[1] <= now]
        if not eligible:
            return ReclaimReport()
        results = await asyncio.gather(*(self.reclaim_version(v) for v in eligible))
        for result in results:
            if result.outcome is ReclaimOutcome.PENDING:
                failures = self._retry_at.get(result.version_id, (0, 0.0))[0] + 1
                delay = delay_after(self.backoff, failures)
                self._retry_at[result.version_id] = (failures, self._clock() + delay)
            else:
                self._retry_at.pop(result.version_id, None)
        return ReclaimReport(tuple(results))

    @property
    def retry_in(self) -> float | None:
        """Seconds until the background loop retries the earliest version left unconfirmed."""
        if not self._retry_at:
            return None
        return max(0.0, min(at for _, at in self._retry_at.values()) - self._clock())

    async def reclaim_version(self, version_id: str) -> ReclaimResult:
        """Reclaim one version (joins a reclaim of it already running in this process)."""
        task = self._inflight.get(version_id)
        if task is None:
            task = asyncio.ensure_future(self._reclaim(version_id))
            self._inflight[version_id] = task
            task.add_done_callback(lambda _: self._inflight.pop(version_id, None))
        # Shielded: a caller that gives up must not cancel an unload other callers wait on.
        return await asyncio.shield(task)

    # --- background ---------------------------------------------------------------------------

    def poke(self) -> None:
        """Ask the background loop for a round (after a commit or a Session release)."""
        self._rounds.poke()

    def _finishing(self) -> Iterable[asyncio.Task[object]]:
        # stop(): an unload in flight finishes; its result is kept.
        return self._inflight.values()

    async def settled(self) -> None:
        """Return once no poke is pending and no background round is running (a backoff wait in
        progress counts as settled: :attr:`retry_in` says how long it is)."""
        await self._rounds.settled()

    async def _run(self) -> None:
        failed_rounds = 0
        while True:
            # After a round that failed outright (the registry unreachable), back off as well:
            # a version overdue for its retry must not turn the loop into a busy one.
            retry_in = delay_after(self.backoff, failed_rounds) if failed_rounds else self.retry_in
            if retry_in is None:
                await self._rounds.wake.wait()
            else:
                await self._rounds.wait(retry_in)
            async with self._rounds.round():
                try:
                    await self._round(due_only=True)
                    failed_rounds = 0
                except Exception:
                    logger.exception("reclaim round failed")
                    failed_rounds += 1

    # --- one version --------------------------------------------------------------------------

    async def _reclaim(self, version_id: str) -> ReclaimResult:
        recorder = self.recorder(version_id)
        request_id = new_request_id()
        try:
            async with (
                self.version_locks.hold(version_id),
                recorder.phase(None, Phase.CLAIM_RECLAIM),
            ):
                claim: ReclaimClaim = await self.retry.call(
                    "claim_reclaim",
                    lambda: self.registry.claim_reclaim(
                        request_id=request_id, version_id=version_id
                    ),
                )
        except SessionStillBoundError:
            return ReclaimResult(
                version_id, ReclaimOutcome.STILL_BOUND, timings=tuple(recorder.timings)
            )
        except Exception as exc:
            # The claim's fate is unknown (replies lost) or the version moved on: a later round
            # replays it; claim_reclaim is idempotent.
            code = error_code(exc)
            logger.warning("claim of %s failed: %s", version_id, exc, extra={"version": version_id})
            return ReclaimResult(
                version_id,
                ReclaimOutcome.PENDING,
                errors=(("registry", code),),
                timings=tuple(recorder.timings),
            )
        extra = {"version": version_id}
        self.check_fleet(claim.engines)
        by_name = {e.name: e for e in self.engines}
        todo = [by_name[name] for name in claim.engines if name not in claim.confirmed]
        outcomes = await asyncio.gather(*(self._reclaim_on(recorder, e, claim) for e in todo))
        confirmed = set(claim.confirmed)
        errors: list[tuple[str, str]] = []
        for engine, outcome in zip(todo, outcomes, strict=True):
            if isinstance(outcome, str):
                errors.append((engine.name, outcome))
            else:
                confirmed.add(engine.name)
        unconfirmed = tuple(e for e in claim.engines if e not in confirmed)
        outcome_kind = ReclaimOutcome.PENDING if unconfirmed else ReclaimOutcome.RECLAIMED
        if unconfirmed:
            logger.warning(
                "reclaim of %s unconfirmed on %s; its slot stays held",
                version_id,
                unconfirmed,
                extra=extra,
            )
        else:
            logger.info("%s reclaimed on every engine", version_id, extra=extra)
        return ReclaimResult(
            version_id,
            outcome_kind,
            lora_name=claim.lora_name,
            reclaim_id=claim.reclaim_id,
            confirmed=tuple(e for e in claim.engines if e in confirmed),
            unconfirmed=unconfirmed,
            errors=tuple(errors),
            timings=tuple(recorder.timings),
        )

    async def _reclaim_on(
        self, recorder: PhaseRecorder, engine: EngineRef, claim: ReclaimClaim
    ) -> VersionStatus | str:
        """The registry's status after this engine's confirmation, or the failure's code
        (``ENGINE_EJECTED`` for an engine ejected before or while it was asked)."""

        def ejected() -> str:
            logger.warning(
                "reclaim not waited for on an ejected engine; retried once it rejoins",
                extra={"engine": engine.name, "version": claim.version_id},
            )
            return ENGINE_EJECTED

        work = self._unload_on(recorder, engine, claim)
        return await unless_ejected(self.ejections, engine.name, work, ejected)

    async def _unload_on(
        self, recorder: PhaseRecorder, engine: EngineRef, claim: ReclaimClaim
    ) -> VersionStatus | str:
        extra = {"engine": engine.name, "version": claim.version_id}

        async def confirm(rid: str) -> VersionStatus:
            return await self.registry.confirm_reclaim(
                request_id=rid,
                version_id=claim.version_id,
                reclaim_id=claim.reclaim_id,
                engine=engine.name,
            )

        try:
            async with recorder.phase(engine.name, Phase.RECLAIM):
                await self.backend.reclaim(
                    engine, lora_name=claim.lora_name, reclaim_id=claim.reclaim_id
                )
            return await registry_step(
                recorder, engine.name, Phase.CONFIRM_RECLAIM, self.retry, confirm
            )
        except Exception as exc:
            # Collected: the other engines' unloads run to their own end.
            logger.warning("reclaim unconfirmed on %s: %s", engine.name, exc, extra=extra)
            return error_code(exc)
