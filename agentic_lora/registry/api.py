"""The registry as its callers see it: every verb declared once, whatever runs behind it.

:class:`RegistryAPI` is the one declaration of the registry's verbs. Each mutating verb is a
keyword-only method that becomes one :meth:`RegistryAPI._call` ``(verb, request_id, args)``; an
implementation only says how such a call is carried out, and how the two reads are answered.
Two implementations ship: :class:`~agentic_lora.registry.local.LocalRegistry` (in-process,
optionally journaled) and :class:`~agentic_lora.registry.ray_actor.RayRegistryClient` (the
same registry as a Ray actor). The Session middleware, the publisher and the reclaimer only
ever talk to this class.

Every mutating verb takes ``request_id``, a caller-minted idempotency key
(:func:`~agentic_lora.registry.types.new_request_id`). A lost reply is normal (a Ray actor error
after the call ran, a timeout): replay the call with the same ``request_id`` and you get the
original answer, including the original error (see :mod:`agentic_lora.foundation.replay`).

Optional capabilities are typed Protocols, found only through the functions here, never by
``getattr`` or by the implementation's class:

* :class:`VersionPeek` (:func:`peeker`): a synchronous, I/O-free ``peek_version``, which the
  dispatch guard needs on the hot path (both shipped implementations have it);
* :class:`ChangeFeed` (:func:`change_feed`): ``add_listener``, told every applied state change
  (in-process registries only: a listener runs inside the registry's apply step);
* :class:`InProcessCore` (:func:`in_process_core`): the :class:`RegistryCore` itself, for exact
  synchronous reads where the registry lives in this process;
* :class:`RefusalFeed` (:func:`refusal_feed`): ``on_refused``, for registries that cache
  versions and must re-read one when an engine refused a request for it;
* :class:`SessionCloser` (:func:`session_closer`): ``close_session_now``, a Session's
  ``begin_close``, ``release`` and ``forget_sessions`` as one synchronous step (in-process
  registries only: nothing can lose its reply);
* :class:`RegistryHost` (:func:`registry_host`): ``start``, which makes the registry host take up
  its own duties now (resume the leases a restart replayed, sweep every lease it holds) instead
  of at the first call.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from collections.abc import Sequence
from typing import TYPE_CHECKING
from typing import Any
from typing import Protocol
from typing import TypeVar
from typing import runtime_checkable

from agentic_lora.registry.types import Binding
from agentic_lora.registry.types import CommitReceipt
from agentic_lora.registry.types import LeaseGrant
from agentic_lora.registry.types import MemberState
from agentic_lora.registry.types import NamedSession
from agentic_lora.registry.types import ReadyReceipt
from agentic_lora.registry.types import ReclaimClaim
from agentic_lora.registry.types import RegistryStatus
from agentic_lora.registry.types import ReleaseResult
from agentic_lora.registry.types import Reservation
from agentic_lora.registry.types import SessionStatus
from agentic_lora.registry.types import SweepResult
from agentic_lora.registry.types import VersionStatus

if TYPE_CHECKING:
    from agentic_lora.registry.core import RegistryCore

__all__ = [
    "ChangeFeed",
    "InProcessCore",
    "RefusalFeed",
    "RegistryAPI",
    "RegistryHost",
    "RegistryListener",
    "SessionCloser",
    "VersionPeek",
    "change_feed",
    "in_process_core",
    "peeker",
    "refusal_feed",
    "registry_host",
    "session_closer",
]

T = TypeVar("T")

#: Called after every applied state change with the verb and its result (not on replays).
RegistryListener = Callable[[str, Any], None]


class RegistryAPI(abc.ABC):
    """Every registry verb. Implement :meth:`_call`, :meth:`status` and :meth:`version`."""

    @abc.abstractmethod
    async def _call(self, verb: str, request_id: str, args: dict[str, Any]) -> Any:
        """Carry out one verb; return its result or raise its typed error."""

    async def _ask(self, answer: type[T], verb: str, request_id: str, args: dict[str, Any]) -> T:
        """:meth:`_call`, its result typed ``answer`` (the verb's declared result: the
        implementation is trusted, not checked, as with any reply)."""
        result: T = await self._call(verb, request_id, args)
        return result

    # --- reads -------------------------------------------------------------------------------

    @abc.abstractmethod
    async def status(self) -> RegistryStatus:
        """A consistent picture of versions, default, capacity and engines."""

    @abc.abstractmethod
    async def version(self, version_id: str) -> VersionStatus:
        """One version's status (UNKNOWN_VERSION if there is none)."""

    # --- publication ---------------------------------------------------------------------------

    async def reserve(self, *, request_id: str, version_id: str, digest: str) -> Reservation:
        """Admit a version (takes a capacity slot) before any transfer starts."""
        args = {"version_id": version_id, "digest": digest}
        return await self._ask(Reservation, "reserve", request_id, args)

    async def record_ready(self, *, request_id: str, receipt: ReadyReceipt) -> VersionStatus:
        """Record one engine's READY for the current attempt and incarnation."""
        return await self._ask(VersionStatus, "record_ready", request_id, {"receipt": receipt})

    async def observe_incarnation(self, *, request_id: str, engine: str, incarnation: str) -> bool:
        """Tell the registry an engine's current incarnation; a change drops its pending READYs."""
        args = {"engine": engine, "incarnation": incarnation}
        return await self._ask(bool, "observe_incarnation", request_id, args)

    async def commit(
        self, *, request_id: str, version_id: str, attempt: int, expected_default_revision: int
    ) -> CommitReceipt:
        """The only place the default changes. Needs READY from every engine."""
        args = _default_move(version_id, attempt, expected_default_revision)
        return await self._ask(CommitReceipt, "commit", request_id, args)

    async def abort(
        self, *, request_id: str, version_id: str, attempt: int, reason: str
    ) -> VersionStatus:
        """LOADING -> ABORTED; the slot stays held until every engine confirms cleanup."""
        args = {"version_id": version_id, "attempt": attempt, "reason": reason}
        return await self._ask(VersionStatus, "abort", request_id, args)

    async def confirm_cleanup(
        self, *, request_id: str, version_id: str, attempt: int, engine: str
    ) -> VersionStatus:
        """One engine holds nothing of this attempt; all engines -> FAILED_CLEAN, slot freed."""
        args = {"version_id": version_id, "attempt": attempt, "engine": engine}
        return await self._ask(VersionStatus, "confirm_cleanup", request_id, args)

    # --- rollback ------------------------------------------------------------------------------

    async def reserve_rollback(self, *, request_id: str, version_id: str) -> Reservation:
        """A rollback to a RECLAIMED version: admit its slot and start a new attempt of the same
        content (RECLAIMED -> LOADING); prepare, record READY and ``commit`` it as any attempt."""
        return await self._ask(
            Reservation, "reserve_rollback", request_id, {"version_id": version_id}
        )

    async def rollback(
        self, *, request_id: str, version_id: str, attempt: int, expected_default_revision: int
    ) -> CommitReceipt:
        """A rollback to a RETIRED version: the default again once every engine holds it."""
        args = _default_move(version_id, attempt, expected_default_revision)
        return await self._ask(CommitReceipt, "rollback", request_id, args)

    # --- Sessions ------------------------------------------------------------------------------

    async def bind_first(
        self, *, request_id: str, session_key: str, lease: str | None = None
    ) -> Binding:
        """Bind to the current default and take a Session ref (a second call: the same answer).

        With ``lease`` the ref is held under that owner lease and released when it ends.
        """
        args: dict[str, Any] = {"session_key": session_key}
        if lease is not None:
            args["lease"] = lease
        return await self._ask(Binding, "bind_first", request_id, args)

    async def begin_close(self, *, request_id: str, session_key: str) -> SessionStatus:
        """Refuse any later bind for this Session (works before a bind, too)."""
        return await self._ask(
            SessionStatus, "begin_close", request_id, {"session_key": session_key}
        )

    async def release(self, *, request_id: str, session_key: str) -> ReleaseResult:
        """Drop the Session ref exactly once; leaves a CLOSED tombstone."""
        return await self._ask(ReleaseResult, "release", request_id, {"session_key": session_key})

    async def forget_sessions(self, *, request_id: str, session_keys: Sequence[str]) -> int:
        """Drop CLOSED tombstones once the local records are gone (bounded memory)."""
        return await self._ask(
            int, "forget_sessions", request_id, {"session_keys": list(session_keys)}
        )

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
        """Start (or renew) ``owner``'s lease for this incarnation; a new incarnation ends the
        previous one at once, releasing (``"release"``) or adopting (``"adopt"``) its Sessions."""
        args = {"owner": owner, "incarnation": incarnation, "ttl": ttl, "on_restart": on_restart}
        return await self._ask(LeaseGrant, "open_lease", request_id, args)

    async def renew_lease(self, *, request_id: str, owner: str, incarnation: str) -> LeaseGrant:
        """Extend a live lease by its TTL (LEASE_EXPIRED once it expired or was superseded)."""
        args = {"owner": owner, "incarnation": incarnation}
        return await self._ask(LeaseGrant, "renew_lease", request_id, args)

    async def close_lease(
        self, *, request_id: str, owner: str, incarnation: str
    ) -> tuple[str, ...]:
        """End a lease on purpose; Sessions still on it are expired (their refs released)."""
        # Any sequence of names (a Ray reply may carry a list), handed out as a tuple.
        names: Sequence[str] = await self._call(
            "close_lease", request_id, {"owner": owner, "incarnation": incarnation}
        )
        return tuple(names)

    async def resume_leases(self, *, request_id: str) -> int:
        """Give every live lease a full TTL from now (the registry host was down)."""
        return await self._ask(int, "resume_leases", request_id, {})

    async def sweep(self, *, request_id: str, name_ttl: float) -> SweepResult:
        """Expire leases past their deadline; forget name tombstones older than ``name_ttl``."""
        return await self._ask(SweepResult, "sweep", request_id, {"name_ttl": name_ttl})

    async def open_named(
        self, *, request_id: str, name: str, session_key: str, lease: str | None
    ) -> NamedSession:
        """The Session behind a client-chosen name (created on first use; never re-bound)."""
        args = {"name": name, "session_key": session_key, "lease": lease}
        return await self._ask(NamedSession, "open_named", request_id, args)

    # --- reclaim -------------------------------------------------------------------------------

    async def claim_reclaim(self, *, request_id: str, version_id: str) -> ReclaimClaim:
        """RETIRED with zero Session refs -> RECLAIMING with a stable reclaim id."""
        return await self._ask(
            ReclaimClaim, "claim_reclaim", request_id, {"version_id": version_id}
        )

    async def confirm_reclaim(
        self, *, request_id: str, version_id: str, reclaim_id: str, engine: str
    ) -> VersionStatus:
        """One engine unloaded the version; all engines -> RECLAIMED, slot freed."""
        args = {"version_id": version_id, "reclaim_id": reclaim_id, "engine": engine}
        return await self._ask(VersionStatus, "confirm_reclaim", request_id, args)

    # --- membership (see agentic_lora.registry.membership) ---------------------------------------

    async def _member(self, verb: str, request_id: str, args: dict[str, Any]) -> MemberState:
        # A remote registry answers the state's wire form (its value): the same Enum either way.
        return MemberState(await self._call(verb, request_id, args))

    async def join_engine(self, *, request_id: str, engine: str) -> MemberState:
        """A new engine joins as JOINING: not routable, not counted for readiness yet."""
        return await self._member("join_engine", request_id, {"engine": engine})

    async def activate_engine(
        self, *, request_id: str, engine: str, incarnation: str
    ) -> MemberState:
        """JOINING or EJECTED -> ACTIVE once the engine holds every dispatchable version."""
        args = {"engine": engine, "incarnation": incarnation}
        return await self._member("activate_engine", request_id, args)

    async def drain_engine(self, *, request_id: str, engine: str) -> MemberState:
        """ACTIVE or JOINING -> DRAINING: the engine takes no new work."""
        return await self._member("drain_engine", request_id, {"engine": engine})

    async def eject_engine(
        self, *, request_id: str, engine: str, incarnation: str | None
    ) -> MemberState:
        """-> EJECTED: the engine failed its health probes (fenced by ``incarnation``)."""
        args = {"engine": engine, "incarnation": incarnation}
        return await self._member("eject_engine", request_id, args)

    async def remove_engine(self, *, request_id: str, engine: str) -> MemberState:
        """DRAINING or EJECTED -> REMOVED: the engine leaves the fleet."""
        return await self._member("remove_engine", request_id, {"engine": engine})


def _default_move(version_id: str, attempt: int, expected_default_revision: int) -> dict[str, Any]:
    """The arguments of a verb that moves the default (``commit``, ``rollback``)."""
    return {
        "version_id": version_id,
        "attempt": attempt,
        "expected_default_revision": expected_default_revision,
    }


# --- optional capabilities ---------------------------------------------------------------------


@runtime_checkable
class VersionPeek(Protocol):
    """A registry that answers one version's status synchronously, without I/O."""

    def peek_version(self, version_id: str) -> VersionStatus | None: ...


@runtime_checkable
class ChangeFeed(Protocol):
    """A registry that tells listeners about every applied state change."""

    def add_listener(self, listener: RegistryListener) -> None: ...


@runtime_checkable
class InProcessCore(Protocol):
    """A registry whose state machine lives in this process."""

    @property
    def core(self) -> RegistryCore: ...


@runtime_checkable
class RefusalFeed(Protocol):
    """A registry that wants to hear when an engine refused a request for a bound version."""

    def on_refused(self, engine: str, binding: Binding) -> object: ...


@runtime_checkable
class SessionCloser(Protocol):
    """A registry that closes a Session in one synchronous step when it can answer at once."""

    def close_session_now(self, session_key: str) -> ReleaseResult | None:
        """``begin_close``, ``release`` and ``forget_sessions`` of ``session_key``, applied
        together; None (nothing applied) when the registry would have to wait: use the verbs."""
        ...


@runtime_checkable
class RegistryHost(Protocol):
    """A registry (or a client of one) whose host can be told to take up its duties now: the
    expiry of every lease and name it holds, whoever opened them and whether or not any call
    comes."""

    async def start(self) -> None: ...


def peeker(registry: object) -> VersionPeek | None:
    """``registry`` as a :class:`VersionPeek`, or None when it has no synchronous read."""
    return registry if isinstance(registry, VersionPeek) else None


def change_feed(registry: object) -> ChangeFeed | None:
    """``registry`` as a :class:`ChangeFeed`, or None when it reports no changes."""
    return registry if isinstance(registry, ChangeFeed) else None


def in_process_core(registry: object) -> RegistryCore | None:
    """The state machine behind ``registry`` when it lives in this process, else None."""
    return registry.core if isinstance(registry, InProcessCore) else None


def refusal_feed(registry: object) -> RefusalFeed | None:
    """``registry`` as a :class:`RefusalFeed`, or None when refusals are nothing to it."""
    return registry if isinstance(registry, RefusalFeed) else None


def registry_host(registry: object) -> RegistryHost | None:
    """``registry`` as a :class:`RegistryHost`, or None when there is nothing to start."""
    return registry if isinstance(registry, RegistryHost) else None


def session_closer(registry: object) -> SessionCloser | None:
    """``registry`` as a :class:`SessionCloser`, or None when a close must use the verbs."""
    return registry if isinstance(registry, SessionCloser) else None
