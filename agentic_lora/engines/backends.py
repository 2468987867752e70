"""The backend plugin contract: how a version gets onto, and off, one engine.

A backend does the I/O the registry never does. Per engine it can ``prepare`` a version (begin,
transfer, end, exact-version probe) and return a READY receipt, ``cleanup`` a failed attempt, and
``reclaim`` (unregister the exact name, let the engine's own request refcount drain, unload once).

Outcomes are classified, never guessed:

* return normally: done and confirmed;
* :class:`~agentic_lora.errors.BackendRefusedError`: the engine cleanly refused and holds nothing
  of this attempt (safe to release the slot after cleanup);
* :class:`~agentic_lora.errors.BackendAmbiguousError`: the outcome is unknown; the engine may hold
  resources. Callers keep the capacity slot and never treat unknown as released.

Plugins register under the entry-point group ``agentic_lora.backends``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from typing import Protocol
from typing import runtime_checkable

from agentic_lora.adapters.snapshot import AdapterSnapshot
from agentic_lora.errors import BackendAmbiguousError
from agentic_lora.errors import BackendRefusedError
from agentic_lora.foundation.discovery import BACKENDS_GROUP
from agentic_lora.foundation.discovery import build_plugin
from agentic_lora.foundation.identity import VersionRef
from agentic_lora.registry.types import ReadyReceipt

__all__ = [
    "Backend",
    "EngineRef",
    "IncarnationRecheck",
    "PublicationTarget",
    "load_backend",
    "target_ambiguous",
    "target_refused",
]


@dataclass(frozen=True, slots=True)
class EngineRef:
    """One engine of the fixed fleet: a stable name and its HTTP base URL."""

    name: str
    base_url: str


PublicationTarget = VersionRef
"""What one publication attempt puts on an engine: that attempt's
:class:`~agentic_lora.foundation.identity.VersionRef`. A backend's READY receipt carries the very
target it was asked to prepare (``ReadyReceipt(engine=..., ref=target, incarnation=...)``)."""


def target_refused(
    engine: EngineRef, target: PublicationTarget, message: str, *, reason: str, **details: Any
) -> BackendRefusedError:
    """``engine`` provably holds nothing of ``target``: the error, with engine, version and reason."""
    return BackendRefusedError(
        message, engine=engine.name, version=target.version_id, reason=reason, **details
    )


def target_ambiguous(
    engine: EngineRef, target: PublicationTarget, message: str, *, reason: str, **details: Any
) -> BackendAmbiguousError:
    """``engine`` may hold ``target`` after all: the error, with engine, version and reason."""
    return BackendAmbiguousError(
        message, engine=engine.name, version=target.version_id, reason=reason, **details
    )


@runtime_checkable
class Backend(Protocol):
    async def incarnation(self, engine: EngineRef) -> str:
        """An id that changes whenever the engine process restarts."""
        ...

    async def prepare(
        self, engine: EngineRef, target: PublicationTarget, snapshot: AdapterSnapshot
    ) -> ReadyReceipt:
        """Load ``snapshot`` under ``target.lora_name`` (pinned) and prove it is there."""
        ...

    async def cleanup(self, engine: EngineRef, target: PublicationTarget) -> None:
        """Make sure the engine holds nothing of this attempt (idempotent; stale attempts fenced)."""
        ...

    async def reclaim(self, engine: EngineRef, *, lora_name: str, reclaim_id: str) -> None:
        """Unload a retired version once in-flight requests using it have finished (idempotent)."""
        ...

    async def aclose(self) -> None:
        """Release clients and sidecar connections."""
        ...


@runtime_checkable
class IncarnationRecheck(Protocol):
    """A backend with a cheaper read of an engine's incarnation for a restart check alone.

    :meth:`Backend.incarnation` may double as a health probe (the repairer's); right before a
    commit only "did it restart since its READY?" is asked, which the backend may answer from a
    cheaper read (the HTTP push backend: the adapter listing, while it still names every adapter
    the backend loaded there). The answer is the same id :meth:`Backend.incarnation` would give.
    """

    async def recheck_incarnation(self, engine: EngineRef) -> str:
        """``engine``'s incarnation, read as cheaply as still shows a restart."""
        ...


def load_backend(name: str, **options: Any) -> Any:
    """Instantiate the backend plugin registered as ``name`` and check it is a Backend."""
    return build_plugin(BACKENDS_GROUP, name, Backend, options)
