"""Owner leases: the rules of an owner incarnation's lease over the registry's state.

Every Session and durable name may hang on the lease of the process that owns it (a rollout
worker, a gateway). A lease lives while its owner renews it; when it ends (expired, closed, or
superseded by the owner's next incarnation) the Sessions on it drop their version refs, so a dead
owner can never pin a retired version, and its names are tombstoned. An incarnation never comes
back: a late call from a dead one is refused, not revived. Time comes in as ``now`` from the front
end, so a journal replays every expiry exactly as it first happened.
"""

from __future__ import annotations

from agentic_lora.errors import InvalidStateError
from agentic_lora.registry.durable_names import tombstone
from agentic_lora.registry.session_lifecycle import expire_session
from agentic_lora.registry.state import LeaseRecord
from agentic_lora.registry.state import NameRecord
from agentic_lora.registry.state import RegistryState
from agentic_lora.registry.state import check_time
from agentic_lora.registry.state import check_token
from agentic_lora.registry.state import lease_id
from agentic_lora.registry.types import LeaseGrant
from agentic_lora.registry.types import SweepResult
from agentic_lora.registry.views import lease_grant

__all__ = [
    "ON_RESTART",
    "close_lease",
    "end_lease",
    "open_lease",
    "renew_lease",
    "resume_leases",
    "sweep",
    "sweep_due",
]

#: What a new incarnation of an owner does with its predecessor's Sessions: a rollout worker's
#: Sessions died with it ("release"); a gateway's belong to agents that outlive it ("adopt").
ON_RESTART: frozenset[str] = frozenset({"release", "adopt"})

#: Dead lease ids remembered so a late call from a dead incarnation is refused, not revived.
_DEAD_LEASE_MEMORY = 4096


def end_lease(state: RegistryState, lease: LeaseRecord, why: str) -> tuple[str, ...]:
    """Expire every Session and name of ``lease`` and forget it; the keys that held a ref."""
    released = tuple(k for k in sorted(lease.sessions) if expire_session(state, k))
    for name in sorted(lease.names):
        tombstone(state, name, why)
    del state._leases[lease.lease_id]
    if state._owners.get(lease.owner) == lease.lease_id:
        del state._owners[lease.owner]
    state._dead_leases[lease.lease_id] = why
    while len(state._dead_leases) > _DEAD_LEASE_MEMORY:
        state._dead_leases.popitem(last=False)
    return released


def open_lease(
    state: RegistryState,
    owner: str,
    incarnation: str,
    ttl: float,
    now: float,
    on_restart: str = "release",
) -> LeaseGrant:
    check_token(owner, "owner")
    check_token(incarnation, "incarnation")
    ttl = check_time(ttl, "ttl", positive=True)
    now = check_time(now, "now")
    if on_restart not in ON_RESTART:
        raise InvalidStateError(
            f"on_restart must be one of {sorted(ON_RESTART)}", reason="bad_on_restart"
        )
    new_id = lease_id(owner, incarnation)
    current = state._leases.get(new_id)
    if current is not None:
        state._tick(now)
        current.ttl = ttl
        current.expires_at = now + ttl
        return lease_grant(current)
    if new_id in state._dead_leases:
        state._live_lease(new_id)  # raises: an incarnation never comes back
    state._tick(now)
    lease = LeaseRecord(owner, incarnation, ttl, now + ttl)
    released: tuple[str, ...] = ()
    adopted: tuple[str, ...] = ()
    previous_id = state._owners.get(owner)
    if previous_id is not None:
        previous = state._leases[previous_id]
        if on_restart == "adopt":
            # The agents behind a gateway outlive it: their Sessions move to the new lease.
            adopted = tuple(sorted(previous.sessions))
            for key in adopted:
                state._sessions[key].lease = new_id
            for name in previous.names:
                state._names[name].lease = new_id
            lease.sessions, lease.names = previous.sessions, previous.names
            previous.sessions, previous.names = set(), set()
        # A worker's Sessions died with it: release them now instead of after the TTL.
        released = end_lease(state, previous, "owner_restarted")
    state._leases[new_id] = lease
    state._owners[owner] = new_id
    return lease_grant(lease, released, adopted)


def renew_lease(state: RegistryState, owner: str, incarnation: str, now: float) -> LeaseGrant:
    now = check_time(now, "now")
    lease = state._live_lease(lease_id(owner, incarnation))
    state._tick(now)
    lease.expires_at = now + lease.ttl
    return lease_grant(lease)


def close_lease(state: RegistryState, owner: str, incarnation: str) -> tuple[str, ...]:
    """End a lease on purpose (an owner shutting down); returns the Sessions it released."""
    lease = state._leases.get(lease_id(owner, incarnation))
    if lease is None:
        return ()  # already ended (expired, superseded, or a replayed close)
    return end_lease(state, lease, "owner_closed")


def resume_leases(state: RegistryState, now: float) -> int:
    """Give every live lease a full TTL from ``now`` (after the registry itself was down:
    its owners could not renew while it was gone). Returns how many leases it extended."""
    now = check_time(now, "now")
    state._tick(now)
    for lease in state._leases.values():
        lease.expires_at = max(lease.expires_at, now + lease.ttl)
    return len(state._leases)


def sweep(state: RegistryState, now: float, name_ttl: float) -> SweepResult:
    """Expire every lease past its deadline; forget name tombstones older than ``name_ttl``."""
    now = check_time(now, "now")
    name_ttl = check_time(name_ttl, "name_ttl", positive=True)
    state._tick(now)
    expired = sorted(lid for lid, lease in state._leases.items() if _expired(lease, now))
    sessions: list[str] = []
    for expired_id in expired:
        sessions.extend(end_lease(state, state._leases[expired_id], "expired"))
    stale = [n for n, rec in state._names.items() if _stale(rec, now, name_ttl)]
    for name in stale:
        rec = state._names.pop(name)
        if state._name_of.get(rec.session_key) == name:
            del state._name_of[rec.session_key]
    return SweepResult(tuple(expired), tuple(sessions), len(stale))


def sweep_due(state: RegistryState, now: float, name_ttl: float) -> bool:
    """Whether :func:`sweep` at ``now`` would change anything (a read: nothing journaled)."""
    # The same two rules as sweep: a due sweep that changes nothing, or a needed one never
    # found due, would journal an empty row or keep a dead lease's refs.
    return any(_expired(lease, now) for lease in state._leases.values()) or any(
        _stale(rec, now, name_ttl) for rec in state._names.values()
    )


def _expired(lease: LeaseRecord, now: float) -> bool:
    """A lease is expired by the first sweep at or after its deadline."""
    return lease.expires_at <= now


def _stale(rec: NameRecord, now: float, name_ttl: float) -> bool:
    """A name tombstone is forgotten once it is ``name_ttl`` old."""
    return rec.closed_at is not None and rec.closed_at + name_ttl <= now
