"""Durable Session names: the rules of a client-chosen name over the registry's state.

A name maps to exactly one registry Session for its whole life. Closing it (or its lease ending)
leaves a tombstone, kept by age, so the name can never open a second lifecycle on any gateway
replica meanwhile; a restarted gateway that opens a live name gets the Session it had, with the
binding it had, so it can never re-bind a running agent to a newer version.
"""

from __future__ import annotations

from agentic_lora.errors import InvalidStateError
from agentic_lora.errors import SessionClosedError
from agentic_lora.errors import SessionExpiredError
from agentic_lora.registry.state import LeaseRecord
from agentic_lora.registry.state import NameRecord
from agentic_lora.registry.state import RegistryState
from agentic_lora.registry.state import check_time
from agentic_lora.registry.state import check_token
from agentic_lora.registry.types import NamedSession

__all__ = ["name_refusal", "named", "open_named", "tombstone"]


def open_named(
    state: RegistryState, name: str, session_key: str, lease: str | None, now: float
) -> NamedSession:
    """The registry Session behind a client's Session ``name``, created on first use.

    A known, live name answers its existing Session (moved to ``lease`` if another lease
    held it); its binding, if any, is the one it had: a restarted gateway can never re-bind
    a running agent to a newer version. A closed or expired name is refused.
    """
    check_token(name, "name")
    check_token(session_key, "session_key")
    now = check_time(now, "now")
    owner = state._live_lease(lease) if lease is not None else None
    rec = state._names.get(name)
    if rec is not None:
        if rec.closed_at is not None:
            raise name_refusal(name, rec)
        state._tick(now)
        adopted = rec.lease != lease
        if adopted:
            _move_name(state, name, rec, owner)
        s = state._sessions.get(rec.session_key)
        return NamedSession(
            name,
            rec.session_key,
            rec.lease,
            s.binding if s is not None else None,
            adopted=adopted,
        )
    if session_key in state._sessions or session_key in state._name_of:
        raise InvalidStateError(
            f"session key {session_key!r} is already in use", reason="session_key_in_use"
        )
    state._tick(now)
    state._names[name] = NameRecord(session_key, lease)
    state._name_of[session_key] = name
    if owner is not None:
        owner.names.add(name)
    return NamedSession(name, session_key, lease)


def _move_name(state: RegistryState, name: str, rec: NameRecord, owner: LeaseRecord | None) -> None:
    if rec.lease is not None and (old := state._leases.get(rec.lease)) is not None:
        old.names.discard(name)
        old.sessions.discard(rec.session_key)
    rec.lease = owner.lease_id if owner is not None else None
    if owner is not None:
        owner.names.add(name)
    s = state._sessions.get(rec.session_key)
    if s is not None:
        s.lease = rec.lease
        if owner is not None and s.state.holds_ref:
            owner.sessions.add(rec.session_key)


def tombstone(state: RegistryState, name: str, why: str) -> None:
    """Close ``name`` for good at the registry's latest time (a no-op if already closed)."""
    rec = state._names.get(name)
    if rec is None or rec.closed_at is not None:
        return
    rec.closed_at = state.now
    rec.why = why
    if rec.lease is not None and (lease := state._leases.get(rec.lease)) is not None:
        lease.names.discard(name)


def name_refusal(name: str, rec: NameRecord) -> Exception:
    if rec.why == "closed":
        return SessionClosedError(
            f"session {name!r} was closed; start a new Session with a new id",
            session=name,
            reason="closed",
        )
    return SessionExpiredError(
        f"session {name!r} expired ({rec.why}); start a new Session with a new id",
        session=name,
        reason=rec.why,
    )


def named(state: RegistryState, name: str) -> NamedSession | None:
    """The live Session behind ``name`` (None if unknown or tombstoned)."""
    rec = state._names.get(name)
    if rec is None or rec.closed_at is not None:
        return None
    s = state._sessions.get(rec.session_key)
    return NamedSession(name, rec.session_key, rec.lease, s.binding if s else None)
