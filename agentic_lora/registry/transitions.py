"""The one transition table of a version's lifecycle.

::

    LOADING --commit--> PUBLISHED --supersede--> RETIRED --claim--> RECLAIMING --reclaimed--> RECLAIMED
       |                    ^                       |                                           |
       |                    +-------rollback--------+                                           |
       +--abort--> ABORTED --cleaned--> FAILED_CLEAN --retry--> LOADING (next attempt)          |
                      |                                                                         |
                      +--reload_cleaned--> RECLAIMED --reload--> LOADING (next attempt) <-------+

A **rollback** makes a version that was committed before the default again, with its exact
identity (version id, digest, lora name: the same ``(epoch, version_id)`` always means the same
bytes). A RETIRED version is still loaded, so it goes straight back to PUBLISHED (``rollback``).
A RECLAIMED one is loaded again first, as a new publication attempt of the same content
(``reload``: a capacity slot is admitted before any transfer), whose ``commit`` is the rollback;
if that attempt is aborted, its cleanup leaves it RECLAIMED again (``reload_cleaned``), never
FAILED_CLEAN: a publication of the same id must stay a no-op, never a way back.

Everything the registry does to a version's state goes through :func:`advance`; an event that the
table does not allow from the current state raises :class:`~agentic_lora.errors.InvalidStateError`
naming the state, the event and the states it would have been legal from.
"""

from __future__ import annotations

import enum

from agentic_lora.errors import InvalidStateError
from agentic_lora.registry.types import VersionState

__all__ = ["TRANSITIONS", "VersionEvent", "advance"]


class VersionEvent(enum.StrEnum):
    COMMIT = "commit"
    SUPERSEDE = "supersede"
    CLAIM_RECLAIM = "claim_reclaim"
    ALL_RECLAIMED = "all_reclaimed"
    ABORT = "abort"
    ALL_CLEANED = "all_cleaned"
    RETRY = "retry"
    ROLLBACK = "rollback"
    RELOAD = "reload"
    RELOAD_CLEANED = "reload_cleaned"


S = VersionState
E = VersionEvent

TRANSITIONS: dict[tuple[VersionState, VersionEvent], VersionState] = {
    (S.LOADING, E.COMMIT): S.PUBLISHED,
    (S.PUBLISHED, E.SUPERSEDE): S.RETIRED,
    (S.RETIRED, E.CLAIM_RECLAIM): S.RECLAIMING,
    (S.RECLAIMING, E.ALL_RECLAIMED): S.RECLAIMED,
    (S.LOADING, E.ABORT): S.ABORTED,
    (S.ABORTED, E.ALL_CLEANED): S.FAILED_CLEAN,
    (S.FAILED_CLEAN, E.RETRY): S.LOADING,
    (S.RETIRED, E.ROLLBACK): S.PUBLISHED,
    (S.RECLAIMED, E.RELOAD): S.LOADING,
    (S.ABORTED, E.RELOAD_CLEANED): S.RECLAIMED,
}


def advance(version_id: str, state: VersionState, event: VersionEvent) -> VersionState:
    """The state after ``event``, or InvalidStateError if the table has no such edge."""
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        allowed = sorted(s.value for (s, e) in TRANSITIONS if e is event)
        raise InvalidStateError(
            f"version {version_id!r} is {state.value}; {event.value} needs {' or '.join(allowed)}",
            version=version_id,
            state=state.value,
            event=event.value,
            allowed_from=allowed,
        ) from None
