"""Rollback: make a version that was the default before the default again, without a restart.

A rollback is a publication of the old version's exact content and identity (its version id,
digest and lora name never change), and two-phase like any other: the default moves only in the
registry's one atomic step that finds every engine READY for the version's current attempt and
incarnation (see :mod:`agentic_lora.registry.rollback`). By the version's state::

    RETIRED     [version lock] observe every incarnation -> re-read -> load it onto every
                engine that lost it (the committed attempt: content from the snapshot cache, the
                backend's store, or the caller) and observe again -> rollback   (no slot taken)
    RECLAIMED   content first -> reserve_rollback (slot admitted before any transfer; one
                reclaim round on CAPACITY_ERROR, then SKIPPED) -> prepare on every engine
                -> observe every incarnation -> commit              (a publication attempt)
    RECLAIMING  one reclaim round finishes the unload; then as RECLAIMED
    otherwise   the registry's answer: a replayed rollback's receipt (ALREADY_PUBLISHED), or its
                typed refusal (ROLLBACK_REFUSED, PUBLICATION_BLOCKED, UNKNOWN_VERSION, ...)

Rules, and what each one prevents:

* It runs under the publisher's lock: one publication, rollback or resolve at a time.
* A RETIRED version is loaded back and rolled back under the version's lock in
  :class:`~agentic_lora.publication.repair.VersionLocks`, which the reclaimer holds around its
  claim: a reclaim cannot start between the loads and the default's move, and a copy loaded for
  the rollback is never left behind a reclaim's unload. A claim by another process's reclaimer
  (the lock cannot see it) shows as the version leaving RETIRED: the rollback starts over as a
  reload. Copies loaded for a rollback that then failed stay with the version's slot, and the
  version's reclaim unloads them.
* A reload is a publication attempt: its failures are aborted and cleaned on every engine, and
  leave the version RECLAIMED again (FAILED_CLEAN result); an unconfirmed cleanup or commit is
  BLOCKED and handed to the resolver, as for a publication.
* The content is verified against the version's digest wherever it comes from (a snapshot of
  other content is refused before any engine is touched).

The result is a :class:`~agentic_lora.publication.result.PublicationResult`: PUBLISHED (its
``commit`` has ``rollback=True``), ALREADY_PUBLISHED (the default is already this rollback's),
SKIPPED (no slot for a reload), FAILED_CLEAN (nothing moved, nothing left pending: a reload aborted
and cleaned, or a RETIRED version that could not be loaded back onto an engine) or BLOCKED.
"""

from __future__ import annotations

import logging

from agentic_lora.errors import CapacityError
from agentic_lora.foundation.phases import Phase
from agentic_lora.publication.ejection import ENGINE_EJECTED
from agentic_lora.publication.publisher import Publisher
from agentic_lora.publication.repair import SnapshotSource
from agentic_lora.publication.repair import VersionLocks
from agentic_lora.publication.result import EngineReport
from agentic_lora.publication.result import PublicationOutcome
from agentic_lora.publication.result import PublicationResult
from agentic_lora.publication.result import PublicationRun
from agentic_lora.publication.steps import attempt_extra
from agentic_lora.publication.steps import attempt_of
from agentic_lora.publication.steps import registry_step
from agentic_lora.registry.types import CommitReceipt
from agentic_lora.registry.types import MemberState
from agentic_lora.registry.types import ReserveOutcome
from agentic_lora.registry.types import VersionState
from agentic_lora.registry.types import VersionStatus

__all__ = ["RollbackPublisher"]

logger = logging.getLogger(__name__)

#: How often a rollback starts over when the version's state moved under it (a reclaim that
#: finished or claimed it meanwhile); the last round takes the registry's answer as it is.
_ROUNDS = 3


class RollbackPublisher(Publisher):
    """A :class:`~agentic_lora.publication.publisher.Publisher` that also rolls back (see the
    module docstring); the Deployment's publisher."""

    async def rollback(
        self, version_id: str, *, snapshots: SnapshotSource, version_locks: VersionLocks
    ) -> PublicationResult:
        """Make ``version_id`` (committed before) the default again.

        ``snapshots`` gives the version's content where an engine needs it loaded again (it must
        hash to the version's digest); ``version_locks`` are the reclaimer's. Raises the
        registry's typed refusals (see the module docstring) and
        :class:`~agentic_lora.errors.BackendRefusedError` (``reason="snapshot_unavailable"``)
        when the content is needed and cannot be had; returns a result otherwise.
        """
        async with self._lock:
            for round_ in range(_ROUNDS):
                v = await self.registry.version(version_id)
                revision = (await self.registry.status()).default_revision
                run = PublicationRun.of(v, self.recorder(version_id))
                last = round_ == _ROUNDS - 1
                if not last and v.state is VersionState.RETIRED:
                    async with version_locks.hold(version_id):
                        result = await self._reinstate(run, snapshots, revision)
                    if result is not None:
                        return result
                elif v.state is VersionState.RECLAIMED or _reloading(v):
                    return await self._reload(run, v, snapshots, revision)
                elif not last and v.state is VersionState.RECLAIMING and self.reclaimer is not None:
                    await self.reclaimer.reclaim_once()
                else:
                    receipt = await self._rollback_step(run, v, revision)
                    return run.result(PublicationOutcome.ALREADY_PUBLISHED, commit=receipt)
        raise AssertionError("unreachable: the last round always answers")

    async def _reinstate(
        self, run: PublicationRun, snapshots: SnapshotSource, revision: int
    ) -> PublicationResult | None:
        """A RETIRED version back as the default; None if it is no longer RETIRED."""
        # Engines that restarted since it retired hold nothing (its repair stops once no Session
        # holds it): observe them all first, so the re-read under the lock knows who lacks it.
        status = await self.registry.status()
        run.members = self.members_of(
            [e.engine for e in status.engines if e.membership is MemberState.ACTIVE]
        )
        observed = await self._each_member(lambda e: self._observe(run, e), run.members)
        v = await self.registry.version(run.version_id)
        if v.state is not VersionState.RETIRED:
            return None
        run.target = v.ref
        unreadable = [r for r in observed if r.error_code not in (None, ENGINE_EJECTED)]
        if unreadable:
            return self._unreadable(run, unreadable)
        # The ACTIVE members: the set whose READY the rollback needs.
        lacking = [e for e in run.members if e.name not in v.ready_engines]
        if lacking:
            # Load the committed attempt back onto them, as a repair would.
            snapshot = await snapshots.snapshot(v)
            reports = await self._each_member(
                lambda e: self._prepare_one(run, e, snapshot), lacking
            )
            run.reports.update({r.engine: r for r in reports})
            failed = [r for r in reports if not r.ready]
            if failed:
                reason = "; ".join(f"{r.engine}: {r.error_code}" for r in failed)
                return run.result(
                    PublicationOutcome.FAILED_CLEAN, reason=f"not loaded back ({reason})"
                )
            # Right before the default moves: an engine that restarted during the loads must
            # not count (without loads, the observes above were right before it already).
            restarted = await self._each_member(lambda e: self._observe(run, e), run.members)
            unreadable = [r for r in restarted if r.error_code not in (None, ENGINE_EJECTED)]
            if unreadable:
                return self._unreadable(run, unreadable)
        receipt = await self._rollback_step(run, v, revision)
        logger.info(
            "%s is the default again (revision %d, rolled back from %s)",
            run.version_id,
            receipt.default_revision,
            receipt.previous_default,
            extra=attempt_extra(v.ref),
        )
        if self.reclaimer is not None:
            self.reclaimer.poke()  # the version it replaced may be unheld already
        return run.result(PublicationOutcome.PUBLISHED, commit=receipt)

    @staticmethod
    def _unreadable(run: PublicationRun, reports: list[EngineReport]) -> PublicationResult:
        run.reports.update({r.engine: r for r in reports})
        names = ", ".join(r.engine for r in reports)
        return run.result(
            PublicationOutcome.FAILED_CLEAN,
            reason=f"incarnation unknown before the rollback ({names})",
        )

    async def _rollback_step(
        self, run: PublicationRun, v: VersionStatus, revision: int
    ) -> CommitReceipt:
        async def rollback(rid: str) -> CommitReceipt:
            return await self.registry.rollback(
                request_id=rid, expected_default_revision=revision, **attempt_of(v.ref)
            )

        return await registry_step(run.recorder, None, Phase.ROLLBACK, self.retry, rollback)

    async def _reload(
        self, run: PublicationRun, v: VersionStatus, snapshots: SnapshotSource, revision: int
    ) -> PublicationResult:
        """A RECLAIMED version loaded again as a new attempt, whose commit is the rollback."""
        snapshot = await snapshots.snapshot(v)  # before any slot is taken
        reservation = await self._reserve(run, reload=True)
        if reservation is None:
            return run.result(PublicationOutcome.SKIPPED, reason=CapacityError.code)
        run.target = reservation.ref
        run.members = self.members_of(reservation.engines)
        if reservation.outcome is ReserveOutcome.IN_PROGRESS:
            logger.info(
                "resuming the reload of %s (attempt %d)",
                run.version_id,
                reservation.attempt,
                extra=attempt_extra(reservation.ref),
            )
        try:
            result = await self._prepare_and_commit(run, snapshot, revision)
        except BaseException:
            self._left_unresolved(run.version_id)  # LOADING, holding its slot: resolve it
            raise
        if result.outcome is PublicationOutcome.BLOCKED:
            self._left_unresolved(run.version_id)
        return result


def _reloading(v: VersionStatus) -> bool:
    """A reload of a version committed before is LOADING (a rollback left it, e.g. cancelled)."""
    return v.state is VersionState.LOADING and v.published_revision is not None
