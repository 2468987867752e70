"""Session bindings: the rules of a Session's life over the registry's state.

A Session binds once, to the default of the moment, and keeps that binding for its whole life: a
second ``bind_first`` answers the first binding whatever the default is now. Its binding holds one
ref on its version; the ref is dropped exactly once, by ``release`` after ``begin_close`` or by its
owner's lease ending, and a retired version is reclaimable only when no ref is left. A Session that
was closed or expired can never bind again, so a late bind can never pin a retired version.
"""

from __future__ import annotations

from collections.abc import Sequence

from agentic_lora.errors import InvalidStateError
from agentic_lora.errors import NoPublishedVersionError
from agentic_lora.errors import SessionClosedError
from agentic_lora.errors import SessionExpiredError
from agentic_lora.errors import SessionStillBoundError
from agentic_lora.registry.durable_names import name_refusal
from agentic_lora.registry.durable_names import tombstone
from agentic_lora.registry.state import RegistryState
from agentic_lora.registry.state import SessionRecord
from agentic_lora.registry.state import check_time
from agentic_lora.registry.types import Binding
from agentic_lora.registry.types import ReleaseResult
from agentic_lora.registry.types import SessionState
from agentic_lora.registry.types import SessionStatus
from agentic_lora.registry.views import session_status

__all__ = [
    "begin_close",
    "bind_first",
    "close_now",
    "detach",
    "expire_session",
    "forget_sessions",
    "release",
]


def bind_first(state: RegistryState, session_key: str, lease: str | None = None) -> Binding:
    s = state._sessions.get(session_key)
    if s is not None:
        if s.state is SessionState.BOUND:
            assert s.binding is not None
            return s.binding  # the first answer, whatever the default is now
        raise _refusal(session_key, s.state)
    name = state._name_of.get(session_key)
    if name is not None:
        # A named Session binds under its name's lease (a gateway may have adopted it).
        rec = state._names[name]
        if rec.closed_at is not None:
            raise name_refusal(name, rec)
        lease = rec.lease
    owner = state._live_lease(lease) if lease is not None else None
    if state.default_version is None:
        raise NoPublishedVersionError("no version has been published yet", session=session_key)
    v = state._versions[state.default_version]
    v.session_refs += 1
    # The default is committed, so its attempt is final: the ref names exactly what serves.
    binding = Binding(
        session_key=session_key,
        ref=v.ref,
        default_revision=state.default_revision,
        rolled_back_from=state.rolled_back_from,
    )
    state._sessions[session_key] = SessionRecord(SessionState.BOUND, binding, lease)
    if owner is not None:
        owner.sessions.add(session_key)
    return binding


def _refusal(session_key: str, st: SessionState) -> Exception:
    if st is SessionState.EXPIRED:
        return SessionExpiredError(
            f"session {session_key!r} expired with its owner's lease; it can only be closed",
            session=session_key,
            state=st.value,
        )
    return SessionClosedError(
        f"session {session_key!r} is {st.value}; it cannot bind",
        session=session_key,
        state=st.value,
    )


def begin_close(state: RegistryState, session_key: str, now: float | None = None) -> SessionStatus:
    # ``now`` dates a named Session's tombstone (its age bounds how long the name stays
    # refused); without it (a direct core call) the registry's latest time is used.
    if now is not None:
        state._tick(check_time(now, "now"))
    s = state._sessions.get(session_key)
    if s is None:
        # Close before bind: keep a record so a late bind is refused.
        s = state._sessions[session_key] = SessionRecord(SessionState.CLOSING, None)
    elif s.state is SessionState.BOUND:
        s.state = SessionState.CLOSING
    name = state._name_of.get(session_key)
    if name is not None:
        # From now on the name can never open a second lifecycle (on any gateway replica).
        tombstone(state, name, "closed")
    return session_status(session_key, s)


def release(state: RegistryState, session_key: str) -> ReleaseResult:
    s = state._sessions.get(session_key)
    if s is None:
        raise InvalidStateError(
            f"session {session_key!r} is unknown; begin_close first",
            session=session_key,
            reason="unknown_session",
        )
    version_id = s.binding.version_id if s.binding is not None else None
    if s.state in (SessionState.CLOSED, SessionState.EXPIRED):
        # EXPIRED: the lease expiry already dropped the ref; closing it late changes nothing.
        return ReleaseResult(session_key, version_id, released_now=False)
    if s.state is not SessionState.CLOSING:
        raise InvalidStateError(
            f"session {session_key!r} is {s.state.value}; begin_close first",
            session=session_key,
            state=s.state.value,
        )
    s.state = SessionState.CLOSED
    if version_id is not None:
        state._versions[version_id].session_refs -= 1
    detach(state, session_key, s)
    return ReleaseResult(session_key, version_id, released_now=True)


def forget_sessions(state: RegistryState, session_keys: Sequence[str]) -> int:
    keys = list(session_keys)
    sessions = state._sessions
    # A loop, not a comprehension: every close of a Session forgets its key (one key, usually),
    # and a comprehension is a call of its own.
    live = []
    for k in keys:
        s = sessions.get(k)
        if s is not None and s.state.holds_ref:
            live.append(k)
    if live:
        raise SessionStillBoundError(
            f"{len(live)} session(s) are not released yet", sessions=live[:8]
        )
    forgotten = 0
    for k in keys:
        if state._sessions.pop(k, None) is not None:
            forgotten += 1
    # A named Session's name (and its key mapping) outlives the record: it is a tombstone
    # kept by age (see sweep), so the name can never open a second lifecycle meanwhile.
    return forgotten


def close_now(
    state: RegistryState, session_key: str, now: float
) -> tuple[SessionStatus, ReleaseResult]:
    """``begin_close``, ``release`` and ``forget_sessions([session_key])`` as one step, with their
    effects to the letter (a test replays every record state both ways and compares the whole
    state): what ``begin_close`` would answer, and the release. Never refuses once ``now`` is
    valid: after a begin_close the record is CLOSING, CLOSED or EXPIRED, release answers each, and
    a released record holds no ref, so forget takes it. For a caller in the registry's process
    with nothing left to wait for: no request id, nothing journaled, so nothing replays."""
    state._tick(check_time(now, "now"))
    name = state._name_of.get(session_key)
    if name is not None:
        tombstone(state, name, "closed")
    s = state._sessions.pop(session_key, None)
    if s is None:
        # begin_close would keep a CLOSING record, release close it, and forget drop it.
        closing = SessionStatus(session_key, SessionState.CLOSING, None, None)
        return closing, ReleaseResult(session_key, None, released_now=True)
    binding = s.binding
    version_id = binding.version_id if binding is not None else None
    if not s.state.holds_ref:  # CLOSED or EXPIRED: the ref went already
        status = SessionStatus(session_key, s.state, version_id, s.lease)
        return status, ReleaseResult(session_key, version_id, released_now=False)
    if version_id is not None:
        state._versions[version_id].session_refs -= 1
    detach(state, session_key, s)
    status = SessionStatus(session_key, SessionState.CLOSING, version_id, s.lease)
    return status, ReleaseResult(session_key, version_id, released_now=True)


def detach(state: RegistryState, session_key: str, s: SessionRecord) -> None:
    if s.lease is not None and (lease := state._leases.get(s.lease)) is not None:
        lease.sessions.discard(session_key)


def expire_session(state: RegistryState, session_key: str) -> bool:
    """Drop a Session's ref because its lease ended; True if it held one."""
    s = state._sessions.get(session_key)
    if s is None or not s.state.holds_ref:
        return False
    if s.binding is not None:
        state._versions[s.binding.version_id].session_refs -= 1
    s.state = SessionState.EXPIRED
    detach(state, session_key, s)
    return True
