"""The one transition table of a version's lifecycle.

::

    LOADING --commit--> PUBLISHED --supersede--> RETIRED --claim--> RECLAIMING --reclaimed--> RECLAIMED
       |
       +--abort--> ABORTED --cleaned--> FAILED_CLEAN --retry--> LOADING (next attempt)

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
