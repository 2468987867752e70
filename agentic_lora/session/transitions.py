"""A Session's phases and the one table of the moves between them.

Pure: no I/O and no Session object, so the table can be read (and tested) on its own. The Session
in :mod:`~agentic_lora.session.lifecycle` moves only through :func:`next_phase`, which refuses
every move the table does not list with :class:`~agentic_lora.errors.SessionStateError`.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

from agentic_lora.errors import SessionStateError

__all__ = ["TRANSITIONS", "SessionPhase", "next_phase"]


class SessionPhase(enum.StrEnum):
    """Where a Session is in its life (finer than the registry's view of it)."""

    OPEN = "OPEN"  # created; bound to nothing
    BOUND = "BOUND"  # bound to one version for the rest of its life
    FINALIZING = "FINALIZING"  # closing: no new dispatch; release not yet confirmed
    CLOSED = "CLOSED"  # released exactly once; the record is gone


#: The only legal moves. FINALIZING is left only by a confirmed release.
TRANSITIONS: Mapping[SessionPhase, frozenset[SessionPhase]] = {
    SessionPhase.OPEN: frozenset({SessionPhase.BOUND, SessionPhase.FINALIZING}),
    SessionPhase.BOUND: frozenset({SessionPhase.FINALIZING}),
    SessionPhase.FINALIZING: frozenset({SessionPhase.CLOSED}),
    SessionPhase.CLOSED: frozenset(),
}


def next_phase(current: SessionPhase, target: SessionPhase, *, session: str = "") -> SessionPhase:
    """``target`` if the table allows ``current -> target``; otherwise SessionStateError."""
    if target not in TRANSITIONS[current]:
        raise SessionStateError(
            f"session {session!r} cannot go from {current.value} to {target.value}",
            session=session,
            phase=current.value,
            target=target.value,
        )
    return target
