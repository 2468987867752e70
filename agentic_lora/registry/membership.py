"""Engine membership: the one transition table of an engine's place in the fleet.

::

    (not a member) --join--> JOINING --activate--> ACTIVE --drain--> DRAINING --remove--> REMOVED
                                |                   |  ^                |
                                +------drain--------|--|----------------+
                                |                   |  +--activate--+   |
                                +------eject------> EJECTED <-------|---+ (eject)
                                                      |             |
                                                      +-------------+
                                                      +--remove--> REMOVED

Only ACTIVE members are routable for new work and count for readiness: the default moves only
when every ACTIVE member holds the version (``RegistryState._require_ready``). The engines the
fleet was configured with start ACTIVE.

* **join**: a new engine (or one removed before) becomes JOINING. It is not routable and does not
  count for readiness until it is activated.
* **activate**: JOINING (or EJECTED, after a repair) becomes ACTIVE only once the engine's current
  incarnation has been observed and it holds every dispatchable version (the default and every
  version Sessions are bound to: :func:`needed_by_members`) and the pending publication's
  candidate, each under that incarnation. Otherwise ``MEMBER_NOT_READY`` names what is missing.
* **drain**: an ACTIVE or JOINING engine takes no new work. The last ACTIVE member cannot be
  drained (``DRAIN_REFUSED``): the fleet would have nowhere to route.
* **eject**: an engine that failed its health probes leaves the publication set, fenced by its
  incarnation: an ejection decided against an older process of the engine than the registry's
  current one is refused (``ENGINE_RESTARTED``).
* **remove**: a DRAINING (its in-flight requests ended) or EJECTED engine leaves the fleet, with
  everything recorded against it (it holds no slot of any version any more); a cleanup or
  reclaim that only waited for it completes.

The I/O around these steps (loading the versions onto a joining engine, waiting for a draining
engine's in-flight requests) is :mod:`agentic_lora.assembly.membership`'s.

Every function runs inside one atomic step of :class:`~agentic_lora.registry.core.RegistryCore`
(each is a journaled verb, so a replay restores membership exactly).
"""

from __future__ import annotations

import enum

from agentic_lora.errors import ActivateRefusedError
from agentic_lora.errors import DrainRefusedError
from agentic_lora.errors import EjectRefusedError
from agentic_lora.errors import EngineAlreadyMemberError
from agentic_lora.errors import EngineRestartedError
from agentic_lora.errors import MemberNotReadyError
from agentic_lora.errors import MembershipError
from agentic_lora.errors import RemoveRefusedError
from agentic_lora.registry.state import RegistryState
from agentic_lora.registry.state import VersionRecord
from agentic_lora.registry.state import check_token
from agentic_lora.registry.types import MemberState
from agentic_lora.registry.types import VersionState

__all__ = [
    "TRANSITIONS",
    "MemberEvent",
    "activate",
    "advance",
    "drain",
    "eject",
    "join",
    "member_state",
    "needed_by_members",
    "remove",
]


class MemberEvent(enum.StrEnum):
    JOIN = "join"
    ACTIVATE = "activate"
    DRAIN = "drain"
    EJECT = "eject"
    REMOVE = "remove"


M = MemberState
E = MemberEvent

TRANSITIONS: dict[tuple[MemberState, MemberEvent], MemberState] = {
    (M.REMOVED, E.JOIN): M.JOINING,
    (M.JOINING, E.ACTIVATE): M.ACTIVE,
    (M.EJECTED, E.ACTIVATE): M.ACTIVE,
    (M.ACTIVE, E.DRAIN): M.DRAINING,
    (M.JOINING, E.DRAIN): M.DRAINING,
    (M.ACTIVE, E.EJECT): M.EJECTED,
    (M.JOINING, E.EJECT): M.EJECTED,
    (M.DRAINING, E.EJECT): M.EJECTED,
    (M.DRAINING, E.REMOVE): M.REMOVED,
    (M.EJECTED, E.REMOVE): M.REMOVED,
}

#: The typed error of each event the table refuses.
_REFUSED: dict[MemberEvent, type[MembershipError]] = {
    E.JOIN: EngineAlreadyMemberError,
    E.ACTIVATE: ActivateRefusedError,
    E.DRAIN: DrainRefusedError,
    E.EJECT: EjectRefusedError,
    E.REMOVE: RemoveRefusedError,
}


def advance(engine: str, state: MemberState, event: MemberEvent) -> MemberState:
    """The membership after ``event``, or the event's typed error if the table has no edge."""
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        allowed = sorted(s.value for (s, e) in TRANSITIONS if e is event)
        raise _REFUSED[event](
            f"engine {engine!r} is {state.value}; {event.value} needs {' or '.join(allowed)}",
            engine=engine,
            state=state.value,
            event=event.value,
            allowed_from=allowed,
        ) from None


def needed_by_members(v: VersionRecord) -> bool:
    """Whether every ACTIVE member must hold ``v``: the default (PUBLISHED), a RETIRED version
    Sessions are still bound to, and the pending publication's candidate (LOADING). A RETIRED
    version no Session holds is not: nothing can be routed to it again (a rollback to it loads
    it onto every ACTIVE member that lacks it first), and its reclaim finds it absent there."""
    state = v.state
    return (
        state is VersionState.PUBLISHED
        or state is VersionState.LOADING
        or (state is VersionState.RETIRED and v.session_refs > 0)
    )


def member_state(state: RegistryState, engine: str) -> MemberState:
    """The engine's membership (REMOVED for an engine that is not in the fleet)."""
    return state._members.get(engine, MemberState.REMOVED)


def join(state: RegistryState, engine: str) -> MemberState:
    check_token(engine, "engine")
    new = advance(engine, member_state(state, engine), E.JOIN)
    state.engines = (*state.engines, engine)
    state._members[engine] = new
    state._incarnations[engine] = None
    return new


def activate(state: RegistryState, engine: str, incarnation: str) -> MemberState:
    state._engine(engine)
    check_token(incarnation, "incarnation")
    new = advance(engine, member_state(state, engine), E.ACTIVATE)
    known = state._incarnations[engine]
    if known != incarnation:
        raise MemberNotReadyError(
            f"engine {engine!r} incarnation {incarnation!r} is not the observed one ({known!r})",
            engine=engine,
            state=member_state(state, engine).value,
            event=E.ACTIVATE.value,
            incarnation=incarnation,
            current_incarnation=known,
            missing=[],
        )
    missing = [
        v.version_id
        for v in state._versions.values()
        if needed_by_members(v)
        and ((r := v.ready.get(engine)) is None or r.incarnation != incarnation)
    ]
    if missing:
        raise MemberNotReadyError(
            f"engine {engine!r} does not hold {missing} yet",
            engine=engine,
            state=member_state(state, engine).value,
            event=E.ACTIVATE.value,
            missing=missing,
        )
    state._members[engine] = new
    return new


def drain(state: RegistryState, engine: str) -> MemberState:
    state._engine(engine)
    current = member_state(state, engine)
    new = advance(engine, current, E.DRAIN)
    if current is MemberState.ACTIVE and state.active_members() == (engine,):
        raise DrainRefusedError(
            f"engine {engine!r} is the last ACTIVE member; add another before draining it",
            engine=engine,
            state=current.value,
            event=E.DRAIN.value,
            reason="last_active",
        )
    state._members[engine] = new
    return new


def eject(state: RegistryState, engine: str, incarnation: str | None) -> MemberState:
    state._engine(engine)
    known = state._incarnations[engine]
    if incarnation is not None:
        check_token(incarnation, "incarnation")
        if known is not None and known != incarnation:
            # The failed probes were of an older process; the current one is not judged by them.
            raise EngineRestartedError(
                f"ejection of {engine!r} incarnation {incarnation!r}, but the engine is now "
                f"{known!r}",
                engine=engine,
                incarnation=incarnation,
                current_incarnation=known,
            )
    new = advance(engine, member_state(state, engine), E.EJECT)
    state._members[engine] = new
    return new


def remove(state: RegistryState, engine: str) -> MemberState:
    state._engine(engine)
    current = member_state(state, engine)
    new = advance(engine, current, E.REMOVE)
    if len(state.engines) == 1:
        raise RemoveRefusedError(
            f"engine {engine!r} is the last member of the fleet",
            engine=engine,
            state=current.value,
            event=E.REMOVE.value,
            reason="last_member",
        )
    state.engines = tuple(e for e in state.engines if e != engine)
    del state._members[engine]
    del state._incarnations[engine]
    for v in state._versions.values():
        v.ready.pop(engine, None)
        v.cleaned.discard(engine)
        v.reclaimed.discard(engine)
        # A cleanup or reclaim that only waited for this engine is complete now.
        state._settle(v)
    return new
