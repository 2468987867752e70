"""The registry as its callers see it: one async Protocol, whatever runs behind it.

Two implementations share this shape: :class:`~agentic_lora.registry.local.LocalRegistry`
(in-process, optionally journaled), and the Ray actor client
(:class:`~agentic_lora.registry.ray_actor.RayRegistryClient`). The Session middleware, the
publisher and the reclaimer only ever talk to this Protocol.

Every mutating verb takes ``request_id``, a caller-minted idempotency key
(:func:`~agentic_lora.registry.types.new_request_id`). A lost reply is normal (a Ray actor error
after the call ran, a timeout): replay the call with the same ``request_id`` and you get the
original answer, including the original error.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from agentic_lora.registry.types import (
    Binding,
    CommitReceipt,
    LeaseGrant,
    NamedSession,
    ReadyReceipt,
    ReclaimClaim,
    RegistryStatus,
    ReleaseResult,
    Reservation,
    SessionStatus,
    SweepResult,
    VersionStatus,
)

__all__ = ["RegistryAPI"]


@runtime_checkable
class RegistryAPI(Protocol):
    # --- publication -------------------------------------------------------------------------
    async def reserve(self, *, request_id: str, version_id: str, digest: str) -> Reservation:
        """Admit a version (takes a capacity slot) before any transfer starts."""
        ...

    async def record_ready(self, *, request_id: str, receipt: ReadyReceipt) -> VersionStatus:
        """Record one engine's READY for the current attempt and incarnation."""
        ...

    async def observe_incarnation(self, *, request_id: str, engine: str, incarnation: str) -> bool:
        """Tell the registry an engine's current incarnation; a change drops its pending READYs."""
        ...

    async def commit(
        self, *, request_id: str, version_id: str, attempt: int, expected_default_revision: int
    ) -> CommitReceipt:
        """The only place the default changes. Needs READY from every engine."""
        ...

    async def abort(
        self, *, request_id: str, version_id: str, attempt: int, reason: str
    ) -> VersionStatus:
        """LOADING -> ABORTED; the slot stays held until every engine confirms cleanup."""
        ...

    async def confirm_cleanup(
        self, *, request_id: str, version_id: str, attempt: int, engine: str
    ) -> VersionStatus:
        """One engine holds nothing of this attempt; all engines -> FAILED_CLEAN, slot freed."""
        ...

    # --- Sessions ----------------------------------------------------------------------------
    async def bind_first(
        self, *, request_id: str, session_key: str, lease: str | None = None
    ) -> Binding:
        """Bind to the current default and take a Session ref (a second call: the same answer).

        With ``lease`` the ref is held under that owner lease and released when it ends.
        """
        ...

    async def begin_close(self, *, request_id: str, session_key: str) -> SessionStatus:
        """Refuse any later bind for this Session (works before a bind, too)."""
        ...

    async def release(self, *, request_id: str, session_key: str) -> ReleaseResult:
        """Drop the Session ref exactly once; leaves a CLOSED tombstone."""
        ...

    async def forget_sessions(self, *, request_id: str, session_keys: Sequence[str]) -> int:
        """Drop CLOSED tombstones once the local records are gone (bounded memory)."""
        ...

    # --- leases and durable names ------------------------------------------------------------
    async def open_lease(
        self,
        *,
        request_id: str,
        owner: str,
        incarnation: str,
        ttl: float,
        on_restart: str = "release",
    ) -> LeaseGrant:
        """Start (or renew) ``owner``'s lease for this incarnation; a new incarnation ends the
        previous one at once, releasing (``"release"``) or adopting (``"adopt"``) its Sessions."""
        ...

    async def renew_lease(self, *, request_id: str, owner: str, incarnation: str) -> LeaseGrant:
        """Extend a live lease by its TTL (LEASE_EXPIRED once it expired or was superseded)."""
        ...

    async def close_lease(
        self, *, request_id: str, owner: str, incarnation: str
    ) -> tuple[str, ...]:
        """End a lease on purpose; Sessions still on it are expired (their refs released)."""
        ...

    async def resume_leases(self, *, request_id: str) -> int:
        """Give every live lease a full TTL from now (the registry host was down)."""
        ...

    async def sweep(self, *, request_id: str, name_ttl: float) -> SweepResult:
        """Expire leases past their deadline; forget name tombstones older than ``name_ttl``."""
        ...

    async def open_named(
        self, *, request_id: str, name: str, session_key: str, lease: str | None
    ) -> NamedSession:
        """The Session behind a client-chosen name (created on first use; never re-bound)."""
        ...

    # --- reclaim -----------------------------------------------------------------------------
    async def claim_reclaim(self, *, request_id: str, version_id: str) -> ReclaimClaim:
        """RETIRED with zero Session refs -> RECLAIMING with a stable reclaim id."""
        ...

    async def confirm_reclaim(
        self, *, request_id: str, version_id: str, reclaim_id: str, engine: str
    ) -> VersionStatus:
        """One engine unloaded the version; all engines -> RECLAIMED, slot freed."""
        ...

    # --- reads -------------------------------------------------------------------------------
    async def status(self) -> RegistryStatus:
        """A consistent picture of versions, default, capacity and engines."""
        ...

    async def version(self, version_id: str) -> VersionStatus:
        """One version's status (UNKNOWN_VERSION if there is none)."""
        ...
