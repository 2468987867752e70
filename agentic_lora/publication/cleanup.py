"""The abort-and-clean half of a publication, and the per-engine fan-out both halves use.

A publication that cannot commit is aborted in the registry, then cleaned on every engine whatever
its prepare did; the slot is freed (FAILED_CLEAN) only when every engine confirmed, and anything
unconfirmed keeps it (BLOCKED). :class:`~agentic_lora.publication.publisher.Publisher` inherits these steps
from :class:`CleanupSteps`; see :mod:`agentic_lora.publication.publisher` for the rules they keep.

An engine ejected for failing its health probes (:mod:`agentic_lora.publication.ejection`) is not
waited for: its cleanup stops being waited for once it is ejected, and none is sent while it
stays ejected. It stays unconfirmed (the result is BLOCKED, the slot held: the engine may hold
the candidate), and the resolver cleans it there once it answers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from collections.abc import Coroutine
from collections.abc import Sequence
from typing import Any

from agentic_lora.engines.backends import EngineRef
from agentic_lora.engines.backends import IncarnationRecheck
from agentic_lora.errors import BackendRefusedError
from agentic_lora.errors import error_code
from agentic_lora.foundation.phases import Phase
from agentic_lora.publication.ejection import ENGINE_EJECTED
from agentic_lora.publication.ejection import Ejections
from agentic_lora.publication.ejection import unless_ejected
from agentic_lora.publication.result import EngineReport
from agentic_lora.publication.result import PublicationOutcome
from agentic_lora.publication.result import PublicationResult
from agentic_lora.publication.result import PublicationRun
from agentic_lora.publication.steps import FleetWorker
from agentic_lora.publication.steps import attempt_extra
from agentic_lora.publication.steps import attempt_of
from agentic_lora.publication.steps import registry_step
from agentic_lora.registry.types import VersionStatus
from agentic_lora.registry.types import new_request_id

__all__ = ["CleanupSteps"]

logger = logging.getLogger(__name__)


class CleanupSteps(FleetWorker):
    """Observe, fan out over the fleet, abort and clean: the steps a publisher shares."""

    #: Engines ejected for failed probes: a cleanup is not waited for on one (see above).
    ejections: Ejections | None = None

    async def _observe_or_raise(
        self, run: PublicationRun, engine: EngineRef, *, recheck: bool = False
    ) -> str:
        """Read ``engine``'s incarnation and have the registry observe it; return it.

        ``recheck``: only a restart matters to the caller (right before a commit), so a backend's
        cheaper read (:class:`~agentic_lora.engines.backends.IncarnationRecheck`) will do.
        """
        backend = self.backend
        async with run.recorder.phase(engine.name, Phase.OBSERVE):
            if recheck and isinstance(backend, IncarnationRecheck):
                incarnation = await backend.recheck_incarnation(engine)
            else:
                incarnation = await backend.incarnation(engine)
            request_id = new_request_id()
            await self.retry.call(
                "observe_incarnation",
                lambda: self.registry.observe_incarnation(
                    request_id=request_id, engine=engine.name, incarnation=incarnation
                ),
            )
        return incarnation

    async def _each_engine(
        self,
        work: Callable[[EngineRef], Coroutine[Any, Any, EngineReport]],
        engines: Sequence[EngineRef] | None = None,
    ) -> list[EngineReport]:
        # ``work`` never raises (it returns a report), so no sibling is ever cancelled.
        async with asyncio.TaskGroup() as group:
            tasks: list[asyncio.Task[EngineReport]] = [
                group.create_task(work(e)) for e in (engines or self.engines)
            ]
        return [t.result() for t in tasks]

    async def _abort_and_clean(
        self,
        run: PublicationRun,
        *,
        reason: str,
        skip: set[str] | None = None,
        observe_first: bool = False,
    ) -> PublicationResult:
        target = run.attempt
        extra = attempt_extra(target)

        async def abort(rid: str) -> VersionStatus:
            return await self.registry.abort(request_id=rid, reason=reason, **attempt_of(target))

        try:
            await registry_step(run.recorder, None, Phase.ABORT, self.retry, abort)
        except Exception as exc:
            logger.error("abort of %s unconfirmed: %r", target.version_id, exc, extra=extra)
            return run.result(
                PublicationOutcome.BLOCKED,
                reason=f"{reason}; abort unconfirmed ({type(exc).__name__})",
            )
        skipped = skip or set()
        todo = [e for e in self.engines if e.name not in skipped]
        cleaned = await self._each_engine(
            lambda e: self._clean_unless_ejected(run, e, observe_first), todo
        )
        for report in cleaned:
            previous = run.reports.get(report.engine)
            run.reports[report.engine] = EngineReport(
                report.engine,
                ready=previous.ready if previous else False,
                cleaned=report.cleaned,
                error_code=report.error_code or (previous.error_code if previous else None),
                error=report.error or (previous.error if previous else None),
            )
        unconfirmed = [r.engine for r in cleaned if not r.cleaned]
        if unconfirmed:
            logger.error(
                "cleanup of %s unconfirmed on %s; its slot stays held",
                target.version_id,
                unconfirmed,
                extra=extra,
            )
            return run.result(
                PublicationOutcome.BLOCKED,
                reason=f"{reason}; cleanup unconfirmed on {', '.join(unconfirmed)}",
            )
        logger.info("%s failed clean: %s", target.version_id, reason, extra=extra)
        return run.result(
            PublicationOutcome.FAILED_CLEAN,
            reason=reason,
        )

    async def _clean_unless_ejected(
        self, run: PublicationRun, engine: EngineRef, observe_first: bool
    ) -> EngineReport:
        def ejected() -> EngineReport:
            logger.warning(
                "cleanup not waited for on an ejected engine; resolved once it answers again",
                extra=attempt_extra(run.attempt, engine.name),
            )
            return EngineReport(
                engine.name,
                cleaned=False,
                error_code=ENGINE_EJECTED,
                error="engine ejected: its cleanup is retried once it answers again",
            )

        work = self._clean_one(run, engine, observe_first)
        return await unless_ejected(self.ejections, engine.name, work, ejected)

    async def _clean_one(
        self, run: PublicationRun, engine: EngineRef, observe_first: bool = False
    ) -> EngineReport:
        target = run.attempt
        extra = attempt_extra(target, engine.name)
        if observe_first and await self._cleaned_by_restart(run, engine):
            logger.info(
                "%s holds nothing of %s (new incarnation): no cleanup call",
                engine.name,
                target.version_id,
                extra=extra,
            )
            return EngineReport(engine.name, cleaned=True)

        async def confirm(rid: str) -> VersionStatus:
            return await self.registry.confirm_cleanup(
                request_id=rid, engine=engine.name, **attempt_of(target)
            )

        try:
            async with run.recorder.phase(engine.name, Phase.CLEANUP):
                # A refusal means, by contract, that the engine holds nothing of this attempt.
                with contextlib.suppress(BackendRefusedError):
                    await self.backend.cleanup(engine, target)
            status = await registry_step(
                run.recorder, engine.name, Phase.CONFIRM_CLEANUP, self.retry, confirm
            )
        except Exception as exc:
            code = error_code(exc)
            logger.warning("cleanup unconfirmed on %s: %s", engine.name, exc, extra=extra)
            return EngineReport(engine.name, cleaned=False, error_code=code, error=str(exc))
        logger.info("cleanup confirmed on %s (%s)", engine.name, status.state.value, extra=extra)
        return EngineReport(engine.name, cleaned=True)

    async def _cleaned_by_restart(self, run: PublicationRun, engine: EngineRef) -> bool:
        """Whether the registry counts ``engine`` cleaned once its incarnation is observed."""
        target = run.attempt
        try:
            await self._observe_or_raise(run, engine)
            status = await self.registry.version(target.version_id)
        except Exception:
            return False  # unknown: the cleanup call below decides
        return status.attempt == target.attempt and engine.name in status.cleaned_engines
