"""What every publication, reclaim and repair shares: the registry, backend and fleet it acts on
(:class:`FleetWorker`), and the registry step it takes after an engine call.

Each registry verb of these flows is one timed phase named after the verb (``Phase.COMMIT`` is
``commit``), sent under one request id minted for it and replayed with that same id while its
reply may have been lost: the registry answers a replay with the first answer, so the verb takes
effect at most once however often the reply is lost.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Sequence
from typing import ClassVar
from typing import TypedDict
from typing import TypeVar
from typing import Unpack

from agentic_lora.adapters.snapshot import AdapterSnapshot
from agentic_lora.engines.backends import Backend
from agentic_lora.engines.backends import EngineRef
from agentic_lora.engines.backends import PublicationTarget
from agentic_lora.engines.fleet import fixed_fleet
from agentic_lora.errors import ConfigurationError
from agentic_lora.foundation.identity import VersionRef
from agentic_lora.foundation.phases import Phase
from agentic_lora.foundation.phases import PhaseEvent
from agentic_lora.foundation.phases import PhaseRecorder
from agentic_lora.foundation.replay import RegistryRetry
from agentic_lora.registry.api import RegistryAPI
from agentic_lora.registry.types import ReadyReceipt
from agentic_lora.registry.types import VersionStatus
from agentic_lora.registry.types import new_request_id

__all__ = [
    "AttemptKey",
    "FleetOptions",
    "FleetWorker",
    "attempt_extra",
    "attempt_of",
    "record_ready",
    "registry_step",
]

T = TypeVar("T")


class FleetOptions(TypedDict, total=False):
    """The keywords every :class:`FleetWorker` takes besides its own.

    ``registry_retry`` replays registry verbs whose reply may be lost (default: a
    :class:`~agentic_lora.foundation.replay.RegistryRetry`); ``on_progress`` receives a
    :class:`~agentic_lora.foundation.phases.PhaseEvent` per phase start and end (for a CLI);
    ``clock`` only feeds the phase timings (default: ``time.perf_counter``).
    """

    registry_retry: RegistryRetry | None
    on_progress: Callable[[PhaseEvent], None] | None
    clock: Callable[[], float]


class FleetWorker:
    """Acts on one registry through ``backend`` on the fixed fleet ``engines``: the publisher,
    the reclaimer and the repairer (and the repairer's engine probe, through it)."""

    #: How a fleet mismatch names this worker (``"publisher fleet [...] is not the registry's"``).
    role: ClassVar[str] = "worker"

    def __init__(
        self,
        registry: RegistryAPI,
        backend: Backend,
        engines: Sequence[EngineRef],
        **options: Unpack[FleetOptions],
    ) -> None:
        self.registry = registry
        self.backend = backend
        self.engines: tuple[EngineRef, ...] = fixed_fleet(engines)
        self.retry = options.get("registry_retry") or RegistryRetry()
        self.on_progress = options.get("on_progress")
        self._clock = options.get("clock", time.perf_counter)

    def recorder(self, version_id: str | None = None) -> PhaseRecorder:
        """A fresh timing of ``version_id``'s phases (None: of no one version, such as an engine
        probe's), reported to ``on_progress``."""
        return PhaseRecorder(self._clock, self.on_progress, version_id)

    def check_fleet(self, registry_engines: Iterable[str]) -> None:
        """Refuse to act for a registry whose fleet is not within this worker's (a mistake
        for a human): no worker can load on or clean an engine it does not know.

        Raises :class:`~agentic_lora.errors.ConfigurationError` (``check="fleet"``, details
        ``role``, ``engines``: this worker's, ``registry``: the registry's)."""
        mine = sorted(e.name for e in self.engines)
        theirs = sorted(registry_engines)
        # An engine this worker knows may have left the registry's fleet (removed at runtime);
        # one the registry names that this worker does not know can never be acted on.
        if not set(theirs) <= set(mine):
            raise ConfigurationError(
                f"{self.role} fleet {mine} is not the registry's {theirs}",
                check="fleet",
                role=self.role,
                engines=mine,
                registry=theirs,
            )

    async def _prepare_on(
        self,
        recorder: PhaseRecorder,
        engine: EngineRef,
        target: PublicationTarget,
        snapshot: AdapterSnapshot,
    ) -> ReadyReceipt:
        """``snapshot`` prepared on ``engine`` as ``target``, timed as the engine's PREPARE phase
        (a publication and a repair alike); the backend's errors propagate."""
        async with recorder.phase(engine.name, Phase.PREPARE):
            return await self.backend.prepare(engine, target, snapshot)


async def registry_step(
    recorder: PhaseRecorder,
    engine: str | None,
    phase: Phase,
    retry: RegistryRetry,
    call: Callable[[str], Awaitable[T]],
) -> T:
    """``call(request_id)`` timed as ``phase`` on ``engine`` (None: fleet-wide), replayed."""
    # Minted once, outside the replay: every replay must carry the same id.
    request_id = new_request_id()
    async with recorder.phase(engine, phase):
        return await retry.call(phase.value, lambda: call(request_id))


class AttemptKey(TypedDict):
    """The keywords naming one attempt in the registry verbs ``abort``, ``commit`` and
    ``confirm_cleanup`` (passed as ``**attempt_of(target)``; the type checker checks each)."""

    version_id: str
    attempt: int


def attempt_of(target: VersionRef) -> AttemptKey:
    """Both from one :class:`VersionRef`: a verb never names one version with another's attempt."""
    return {"version_id": target.version_id, "attempt": target.attempt}


async def record_ready(
    registry: RegistryAPI, retry: RegistryRetry, recorder: PhaseRecorder, receipt: ReadyReceipt
) -> VersionStatus:
    """Record the READY an engine's prepare returned (publication and repair alike)."""

    async def verb(rid: str) -> VersionStatus:
        return await registry.record_ready(request_id=rid, receipt=receipt)

    return await registry_step(recorder, receipt.engine, Phase.RECORD_READY, retry, verb)


def attempt_extra(target: VersionRef, engine: str | None = None) -> dict[str, object]:
    """The log ``extra=`` keys naming one attempt (and the engine it is on, if any)."""
    extra: dict[str, object] = {"version": target.version_id, "attempt": target.attempt}
    if engine is not None:
        extra["engine"] = engine
    return extra
