"""The registry's mutating verbs, written once for every front end.

:class:`RegistryVerbs` turns each keyword-only verb of
:class:`~agentic_lora.registry.api.RegistryAPI` into one ``_call(verb, request_id, args)``; a
front end (the in-process registry, the Ray client) only says how a call is carried out.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

from agentic_lora.registry.types import (
    Binding,
    CommitReceipt,
    LeaseGrant,
    NamedSession,
    ReadyReceipt,
    ReclaimClaim,
    ReleaseResult,
    Reservation,
    SessionStatus,
    SweepResult,
    VersionStatus,
)

__all__ = ["RegistryVerbs"]


class RegistryVerbs(abc.ABC):
    """Every mutating registry verb, as a call of :meth:`_call`."""

    @abc.abstractmethod
    async def _call(self, verb: str, request_id: str, args: dict[str, Any]) -> Any:
        """Carry out one verb; return its result or raise its typed error."""

    # --- publication ---------------------------------------------------------------------------

    async def reserve(self, *, request_id: str, version_id: str, digest: str) -> Reservation:
        r: Reservation = await self._call(
            "reserve", request_id, {"version_id": version_id, "digest": digest}
        )
        return r

    async def record_ready(self, *, request_id: str, receipt: ReadyReceipt) -> VersionStatus:
        r: VersionStatus = await self._call("record_ready", request_id, {"receipt": receipt})
        return r

    async def observe_incarnation(self, *, request_id: str, engine: str, incarnation: str) -> bool:
        r: bool = await self._call(
            "observe_incarnation", request_id, {"engine": engine, "incarnation": incarnation}
        )
        return r

    async def commit(
        self, *, request_id: str, version_id: str, attempt: int, expected_default_revision: int
    ) -> CommitReceipt:
        r: CommitReceipt = await self._call(
            "commit",
            request_id,
            {
                "version_id": version_id,
                "attempt": attempt,
                "expected_default_revision": expected_default_revision,
            },
        )
        return r

    async def abort(
        self, *, request_id: str, version_id: str, attempt: int, reason: str
    ) -> VersionStatus:
        r: VersionStatus = await self._call(
            "abort", request_id, {"version_id": version_id, "attempt": attempt, "reason": reason}
        )
        return r

    async def confirm_cleanup(
        self, *, request_id: str, version_id: str, attempt: int, engine: str
    ) -> VersionStatus:
        r: VersionStatus = await self._call(
            "confirm_cleanup",
            request_id,
            {"version_id": version_id, "attempt": attempt, "engine": engine},
        )
        return r

    # --- Sessions ------------------------------------------------------------------------------

    async def bind_first(
        self, *, request_id: str, session_key: str, lease: str | None = None
    ) -> Binding:
        args: dict[str, Any] = {"session_key": session_key}
        if lease is not None:
            args["lease"] = lease
        r: Binding = await self._call("bind_first", request_id, args)
        return r

    async def begin_close(self, *, request_id: str, session_key: str) -> SessionStatus:
        r: SessionStatus = await self._call("begin_close", request_id, {"session_key": session_key})
        return r

    async def release(self, *, request_id: str, session_key: str) -> ReleaseResult:
        r: ReleaseResult = await self._call("release", request_id, {"session_key": session_key})
        return r

    async def forget_sessions(self, *, request_id: str, session_keys: Sequence[str]) -> int:
        r: int = await self._call(
            "forget_sessions", request_id, {"session_keys": list(session_keys)}
        )
        return r

    # --- leases and durable names --------------------------------------------------------------

    async def open_lease(
        self,
        *,
        request_id: str,
        owner: str,
        incarnation: str,
        ttl: float,
        on_restart: str = "release",
    ) -> LeaseGrant:
        r: LeaseGrant = await self._call(
            "open_lease",
            request_id,
            {"owner": owner, "incarnation": incarnation, "ttl": ttl, "on_restart": on_restart},
        )
        return r

    async def renew_lease(self, *, request_id: str, owner: str, incarnation: str) -> LeaseGrant:
        r: LeaseGrant = await self._call(
            "renew_lease", request_id, {"owner": owner, "incarnation": incarnation}
        )
        return r

    async def close_lease(
        self, *, request_id: str, owner: str, incarnation: str
    ) -> tuple[str, ...]:
        r: tuple[str, ...] = tuple(
            await self._call(
                "close_lease", request_id, {"owner": owner, "incarnation": incarnation}
            )
        )
        return r

    async def resume_leases(self, *, request_id: str) -> int:
        r: int = await self._call("resume_leases", request_id, {})
        return r

    async def sweep(self, *, request_id: str, name_ttl: float) -> SweepResult:
        r: SweepResult = await self._call("sweep", request_id, {"name_ttl": name_ttl})
        return r

    async def open_named(
        self, *, request_id: str, name: str, session_key: str, lease: str | None
    ) -> NamedSession:
        r: NamedSession = await self._call(
            "open_named", request_id, {"name": name, "session_key": session_key, "lease": lease}
        )
        return r

    # --- reclaim -------------------------------------------------------------------------------

    async def claim_reclaim(self, *, request_id: str, version_id: str) -> ReclaimClaim:
        r: ReclaimClaim = await self._call("claim_reclaim", request_id, {"version_id": version_id})
        return r

    async def confirm_reclaim(
        self, *, request_id: str, version_id: str, reclaim_id: str, engine: str
    ) -> VersionStatus:
        r: VersionStatus = await self._call(
            "confirm_reclaim",
            request_id,
            {"version_id": version_id, "reclaim_id": reclaim_id, "engine": engine},
        )
        return r
