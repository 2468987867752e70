"""The steps of publication, reclaim and repair, and how their progress is reported.

A :class:`PhaseRecorder` times each step (per engine, or fleet-wide when ``engine`` is None),
keeps a :class:`PhaseTiming` for the result and forwards a :class:`PhaseEvent` to a progress
callback. The publisher, the reclaimer and the repairer all report through it, so a progress
listener (the CLI, the gateway's event stream, the metrics) sees one vocabulary.
"""

from __future__ import annotations

import contextlib
import enum
import logging
from collections.abc import AsyncIterator
from collections.abc import Callable
from dataclasses import dataclass

from agentic_lora.errors import error_code

__all__ = ["Phase", "PhaseEvent", "PhaseRecorder", "PhaseStatus", "PhaseTiming"]

logger = logging.getLogger(__name__)


class Phase(enum.StrEnum):
    """Steps of publication, rollback and reclaim (per engine, or fleet-wide when ``engine`` is
    None)."""

    RESERVE = "reserve"
    OBSERVE = "observe_incarnation"
    PREPARE = "prepare"
    RECORD_READY = "record_ready"
    COMMIT = "commit"
    ABORT = "abort"
    CLEANUP = "cleanup"
    CONFIRM_CLEANUP = "confirm_cleanup"
    CLAIM_RECLAIM = "claim_reclaim"
    RECLAIM = "reclaim"
    CONFIRM_RECLAIM = "confirm_reclaim"
    RESERVE_ROLLBACK = "reserve_rollback"
    ROLLBACK = "rollback"


class PhaseStatus(enum.StrEnum):
    STARTED = "STARTED"
    DONE = "DONE"
    FAILED = "FAILED"


@dataclass(frozen=True, slots=True)
class PhaseEvent:
    """What a progress callback receives: a phase started, finished or failed on an engine."""

    engine: str | None
    phase: Phase
    status: PhaseStatus
    seconds: float | None = None
    error_code: str | None = None
    version_id: str | None = None


@dataclass(frozen=True, slots=True)
class PhaseTiming:
    """How long one phase took on one engine (``engine`` None: fleet-wide)."""

    engine: str | None
    phase: Phase
    seconds: float
    ok: bool
    error_code: str | None = None


class PhaseRecorder:
    """Collects phase timings of one publication or reclaim and forwards progress events.

    A failing progress callback is logged and ignored: a listener must never change the outcome
    of the step it watches (an exception there would abort a publication half-way).
    """

    def __init__(
        self,
        clock: Callable[[], float],
        on_progress: Callable[[PhaseEvent], None] | None,
        version_id: str | None = None,
    ) -> None:
        self._clock = clock
        self._on_progress = on_progress
        self._version_id = version_id
        self.timings: list[PhaseTiming] = []

    def _emit(self, event: PhaseEvent) -> None:
        if self._on_progress is None:
            return
        try:
            self._on_progress(event)
        except Exception:
            logger.exception(
                "progress callback failed",
                extra={"phase": event.phase.value, "engine": event.engine},
            )

    @contextlib.asynccontextmanager
    async def phase(self, engine: str | None, phase: Phase) -> AsyncIterator[None]:
        """Time the enclosed block as ``phase`` on ``engine`` (a failure is recorded and re-raised)."""
        start = self._clock()
        vid = self._version_id
        self._emit(PhaseEvent(engine, phase, PhaseStatus.STARTED, version_id=vid))
        try:
            yield
        except BaseException as exc:
            seconds = self._clock() - start
            code = error_code(exc)
            self.timings.append(PhaseTiming(engine, phase, seconds, False, code))
            self._emit(PhaseEvent(engine, phase, PhaseStatus.FAILED, seconds, code, vid))
            raise
        seconds = self._clock() - start
        self.timings.append(PhaseTiming(engine, phase, seconds, True))
        self._emit(PhaseEvent(engine, phase, PhaseStatus.DONE, seconds, version_id=vid))
