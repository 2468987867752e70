"""Frozen views of the registry's state: what its verbs and reads hand out.

Each function copies a record of :mod:`~agentic_lora.registry.state` into an immutable value of
:mod:`~agentic_lora.registry.types`, so no caller can reach the core's mutable bookkeeping. Engine
lists are always in fleet order, whatever order the engines reported in, so the same state always
gives the same view.
"""

from __future__ import annotations

from collections.abc import Collection

from agentic_lora.registry.state import LeaseRecord
from agentic_lora.registry.state import RegistryState
from agentic_lora.registry.state import SessionRecord
from agentic_lora.registry.state import VersionRecord
from agentic_lora.registry.types import DispatchView
from agentic_lora.registry.types import EngineStatus
from agentic_lora.registry.types import LeaseGrant
from agentic_lora.registry.types import LeaseStatus
from agentic_lora.registry.types import MemberState
from agentic_lora.registry.types import ReclaimClaim
from agentic_lora.registry.types import RegistryStatus
from agentic_lora.registry.types import Reservation
from agentic_lora.registry.types import ReserveOutcome
from agentic_lora.registry.types import SessionStatus
from agentic_lora.registry.types import VersionStatus

__all__ = [
    "dispatch_view",
    "lease_grant",
    "lease_status",
    "reclaim_claim",
    "registry_status",
    "reservation",
    "session_status",
    "version_status",
]


def version_status(state: RegistryState, v: VersionRecord) -> VersionStatus:
    engines = state.engines
    return VersionStatus(
        version_id=v.version_id,
        digest=v.digest,
        lora_name=v.lora_name,
        state=v.state,
        attempt=v.attempt,
        session_refs=v.session_refs,
        ready_engines=_routable(state, v.ready),
        cleaned_engines=_in_fleet_order(engines, v.cleaned),
        reclaim_id=v.reclaim_id,
        reclaimed_engines=_in_fleet_order(engines, v.reclaimed),
        published_revision=v.commit_receipt.default_revision if v.commit_receipt else None,
        held_engines=_in_fleet_order(engines, v.ready),
    )


def dispatch_view(state: RegistryState, v: VersionRecord) -> DispatchView:
    # Read once per dispatch by the in-process guard: three fields, not a whole status.
    return DispatchView(v.state, v.lora_name, _routable(state, v.ready))


def _routable(state: RegistryState, holders: Collection[str]) -> tuple[str, ...]:
    """The ACTIVE members among ``holders``, in fleet order: a JOINING, DRAINING or EJECTED
    engine gets no request routed to it, whatever it holds."""
    ready = _in_fleet_order(state.engines, holders)
    if len(state._members) == len(state.engines) and all(
        m is MemberState.ACTIVE for m in state._members.values()
    ):
        return ready
    return tuple(e for e in ready if state._members[e] is MemberState.ACTIVE)


def _in_fleet_order(engines: tuple[str, ...], some: Collection[str]) -> tuple[str, ...]:
    """The engines of ``some`` (a subset of the fleet) in fleet order."""
    if not some:
        return ()
    if len(some) == len(engines):
        return engines
    return tuple(e for e in engines if e in some)


def reservation(state: RegistryState, v: VersionRecord, outcome: ReserveOutcome) -> Reservation:
    # A publication loads on the ACTIVE members: the set whose READY its commit needs.
    return Reservation(ref=v.ref, outcome=outcome, state=v.state, engines=state.active_members())


def reclaim_claim(state: RegistryState, v: VersionRecord) -> ReclaimClaim:
    assert v.reclaim_id is not None
    confirmed = _in_fleet_order(state.engines, v.reclaimed)
    return ReclaimClaim(
        ref=v.ref, reclaim_id=v.reclaim_id, engines=state.engines, confirmed=confirmed
    )


def session_status(session_key: str, s: SessionRecord) -> SessionStatus:
    return SessionStatus(
        session_key,
        s.state,
        s.binding.version_id if s.binding is not None else None,
        s.lease,
    )


def lease_status(lease: LeaseRecord) -> LeaseStatus:
    return LeaseStatus(*_terms(lease), sessions=len(lease.sessions), names=len(lease.names))


def lease_grant(
    lease: LeaseRecord, released: tuple[str, ...] = (), adopted: tuple[str, ...] = ()
) -> LeaseGrant:
    return LeaseGrant(*_terms(lease), released=released, adopted=adopted)


def _terms(lease: LeaseRecord) -> tuple[str, str, str, float, float]:
    """The :class:`~agentic_lora.registry.types.LeaseTerms` of ``lease``, in field order (both
    lease views start with them)."""
    return (lease.lease_id, lease.owner, lease.incarnation, lease.ttl, lease.expires_at)


def registry_status(state: RegistryState) -> RegistryStatus:
    return RegistryStatus(
        deployment_epoch=state.deployment_epoch,
        capacity=state.capacity,
        engines=tuple(
            EngineStatus(e, state._incarnations[e], state._members[e]) for e in state.engines
        ),
        default_version=state.default_version,
        default_revision=state.default_revision,
        slots_in_use=state._slots_in_use(),
        pending_version=state._pending,
        versions=tuple(version_status(state, v) for v in state._versions.values()),
        live_sessions=sum(1 for s in state._sessions.values() if s.state.holds_ref),
        leases=tuple(lease_status(lease) for lease in state._leases.values()),
        named_sessions=sum(1 for rec in state._names.values() if rec.closed_at is None),
        rolled_back_from=state.rolled_back_from,
    )
