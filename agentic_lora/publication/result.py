"""What a publication reports: its outcome, each engine's part, and the phases it timed.

:class:`PublicationResult` is what :meth:`~agentic_lora.publication.publisher.Publisher.publish` and
:meth:`~agentic_lora.publication.publisher.Publisher.resolve` return; :class:`PublicationRun` is the mutable
record one such call fills in as it goes and turns into that result.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from dataclasses import field

from agentic_lora.engines.backends import EngineRef
from agentic_lora.foundation.identity import VersionRef
from agentic_lora.foundation.phases import Phase
from agentic_lora.foundation.phases import PhaseRecorder
from agentic_lora.foundation.phases import PhaseTiming
from agentic_lora.registry.types import CommitReceipt
from agentic_lora.registry.types import VersionStatus

__all__ = ["EngineReport", "PublicationOutcome", "PublicationResult", "PublicationRun"]


class PublicationOutcome(enum.StrEnum):
    """How a publication ended."""

    PUBLISHED = "PUBLISHED"  # committed: the version is the default
    ALREADY_PUBLISHED = "ALREADY_PUBLISHED"  # same id and content was committed before: no-op
    SKIPPED = "SKIPPED"  # capacity refused after bootstrap; nothing was transferred
    FAILED_CLEAN = "FAILED_CLEAN"  # aborted; every engine confirmed cleanup; slot freed
    BLOCKED = "BLOCKED"  # outcome or cleanup unconfirmed: slot held, publications blocked


@dataclass(frozen=True, slots=True)
class EngineReport:
    """One engine's part in a publication."""

    engine: str
    ready: bool = False
    cleaned: bool | None = None  # None: no cleanup was needed
    error_code: str | None = None
    error: str | None = None


@dataclass(frozen=True)
class PublicationResult:
    """The outcome of :meth:`~agentic_lora.publication.publisher.Publisher.publish` or its ``resolve``.

    Every field is always set (:meth:`PublicationRun.result` is its one constructor): None where
    the publication has none (``lora_name`` and ``attempt`` before a reservation, ``commit``
    without a commit, ``reason`` on success).
    """

    version_id: str
    digest: str
    outcome: PublicationOutcome
    bootstrap: bool
    lora_name: str | None
    attempt: int | None
    commit: CommitReceipt | None
    reason: str | None
    engines: tuple[EngineReport, ...]
    timings: tuple[PhaseTiming, ...]

    @property
    def ok(self) -> bool:
        """The version is (now or already) the committed one it names."""
        return self.outcome in (PublicationOutcome.PUBLISHED, PublicationOutcome.ALREADY_PUBLISHED)

    def seconds(self, phase: Phase, engine: str | None = None) -> float:
        """Total time spent in ``phase`` on ``engine`` (fleet-wide phases: ``engine=None``)."""
        return sum(t.seconds for t in self.timings if t.phase is phase and t.engine == engine)


@dataclass
class PublicationRun:
    """Mutable state of one publish/resolve call."""

    version_id: str
    digest: str
    bootstrap: bool
    recorder: PhaseRecorder
    #: The attempt this call publishes or resolves, once known: the result names it.
    target: VersionRef | None = None
    reports: dict[str, EngineReport] = field(default_factory=dict)
    #: The members it loads on and waits for (a reservation's ACTIVE members); empty: all.
    members: tuple[EngineRef, ...] = ()

    @classmethod
    def of(cls, version: VersionStatus, recorder: PhaseRecorder) -> PublicationRun:
        """A run on ``version`` as the registry holds it now (its current attempt), for a
        resolve or a rollback: never a bootstrap."""
        return cls(version.version_id, version.digest, False, recorder, target=version.ref)

    @property
    def attempt(self) -> VersionRef:
        """The attempt every step after the reservation works on.

        The steps read it here rather than taking it beside the run, so the attempt a step
        prepares, commits or cleans is always the one the result names.
        """
        if self.target is None:
            raise RuntimeError(f"publication of {self.version_id!r} has no attempt reserved yet")
        return self.target

    def result(
        self,
        outcome: PublicationOutcome,
        *,
        reason: str | None = None,
        commit: CommitReceipt | None = None,
    ) -> PublicationResult:
        target = self.target
        return PublicationResult(
            version_id=self.version_id,
            digest=self.digest,
            outcome=outcome,
            bootstrap=self.bootstrap,
            lora_name=target.lora_name if target else None,
            attempt=target.attempt if target else None,
            commit=commit,
            reason=reason,
            engines=tuple(self.reports[name] for name in sorted(self.reports)),
            timings=tuple(self.recorder.timings),
        )
