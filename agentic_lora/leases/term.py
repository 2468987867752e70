"""One incarnation's lease as this process sees it (:class:`LeaseTerm`), its states and the events
a keeper's listeners see (the state diagram is in :mod:`agentic_lora.leases`)."""

from __future__ import annotations

import asyncio
import enum
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final
from typing import Protocol

from agentic_lora.errors import SessionExpiredError
from agentic_lora.registry.types import LeaseGrant

__all__ = [
    "LeaseEvent",
    "LeaseEventKind",
    "LeaseListener",
    "LeaseState",
    "LeaseTerm",
    "TermKeeper",
]

logger = logging.getLogger(__name__)


class LeaseState(enum.StrEnum):
    """Where one incarnation's lease is (see the diagram in :mod:`agentic_lora.leases`)."""

    PENDING = "PENDING"  # minted; open_lease not confirmed; nothing binds under it yet
    HELD = "HELD"  # granted; renewed in the background; the local deadline is ahead
    LOST = "LOST"  # the local deadline passed or the registry ended it: for good
    CLOSED = "CLOSED"  # ended on purpose (close_lease at shutdown)


# The hot path compares against these (a module global is cheaper than an enum class attribute).
_HELD: Final = LeaseState.HELD
_PENDING: Final = LeaseState.PENDING


class LeaseEventKind(enum.StrEnum):
    OPENED = "OPENED"
    RENEWED = "RENEWED"
    LOST = "LOST"
    CLOSED = "CLOSED"


@dataclass(frozen=True, slots=True)
class LeaseEvent:
    """One change of a keeper's lease, as its listeners see it.

    ``at`` is on the keeper's clock. ``released``: on OPENED, the predecessor incarnation's Session
    keys the registry released at once; on CLOSED, the Sessions ``close_lease`` released.
    ``adopted``: on OPENED with ``on_restart="adopt"``, the Sessions taken over. ``reason``: on
    LOST, why (``local_deadline``, ``renew_failed``, or the registry's reason).
    """

    kind: LeaseEventKind
    lease_id: str
    at: float
    reason: str | None = None
    released: tuple[str, ...] = ()
    adopted: tuple[str, ...] = ()


#: Called on every :class:`LeaseEvent` (synchronously; must not raise, errors are logged).
LeaseListener = Callable[[LeaseEvent], None]


class TermKeeper(Protocol):
    """The keeper of a term, as the term sees it (:class:`~agentic_lora.leases.LeaseKeeper`).

    Declared here, beside the term, so the term needs nothing from the keeper's module: the
    keeper is built from terms, never the other way round.
    """

    @property
    def owner(self) -> str:
        """The owner id every term of this keeper is a lease of."""
        ...

    def clock(self) -> float:
        """The keeper's monotonic clock, in seconds (deadlines are on it)."""
        ...

    def _touch(self, term: LeaseTerm) -> None:
        """A dispatch used ``term``: wake the renewer if a renewal is overdue (no I/O)."""
        ...

    def _emit(self, kind: LeaseEventKind, term: LeaseTerm, *, reason: str | None = None) -> None:
        """Tell the keeper's listeners what happened to ``term``."""
        ...


class LeaseTerm:
    """One incarnation's lease as this process sees it; a Session keeps the one it bound under."""

    def __init__(self, keeper: TermKeeper, incarnation: str) -> None:
        self._keeper = keeper
        self.incarnation: Final = incarnation
        #: ``"<owner>/<incarnation>"``, the id Sessions bind under.
        self.lease_id: Final = f"{keeper.owner}/{incarnation}"
        self._state = LeaseState.PENDING
        # Set by the first grant; only read while HELD (the hot path compares floats directly).
        self._deadline = math.inf
        self._renewed_at = -math.inf
        self._reason: str | None = None
        self._opening: asyncio.Task[None] | None = None
        # An open_lease for it may have reached the registry: close_lease is owed at shutdown.
        self._sent = False

    @property
    def state(self) -> LeaseState:
        """The current state; reading it notices a passed local deadline (HELD -> LOST)."""
        if self._state is _HELD and self._keeper.clock() >= self._deadline:
            self._lose("local_deadline")
        return self._state

    @property
    def deadline(self) -> float | None:
        """The local deadline, on the keeper's clock (None before the first grant)."""
        return None if self._deadline == math.inf else self._deadline

    @property
    def renewed_at(self) -> float | None:
        """When the last successful open or renew was sent, on the keeper's clock."""
        return None if self._renewed_at == -math.inf else self._renewed_at

    @property
    def lost_reason(self) -> str | None:
        """Why it was lost (None unless LOST)."""
        return self._reason

    def __repr__(self) -> str:
        return f"LeaseTerm({self.lease_id!r}, {self._state.value})"

    def check(self, *, session: str | None = None) -> None:
        """Raise SessionExpiredError unless this lease still holds (sync, no I/O: hot path).

        PENDING passes: nothing is bound under a lease before its grant, and the bind that waits
        for the grant checks again.
        """
        state = self.state
        if state is _HELD or state is _PENDING:
            return
        reason = self._reason if state is LeaseState.LOST else "closed"
        raise SessionExpiredError(
            f"session {session or '?'}: lease {self.lease_id!r} is {state.value} ({reason}); "
            "nothing was sent, the Session can only be closed",
            session=session,
            lease=self.lease_id,
            reason=reason,
        )

    def touch(self) -> None:
        """A dispatch used this lease: wake the renewer if a renewal is overdue (no I/O here)."""
        self._keeper._touch(self)

    def mark_lost(self, reason: str) -> None:
        """Record that the registry answered LEASE_EXPIRED for this lease to another call (a
        bind): lost for good, as if the renewer had been told."""
        self._lose(reason)

    # --- transitions (the keeper drives them) ----------------------------------------------------

    def _granted(self, sent_at: float, grant: LeaseGrant) -> None:
        """Record a successful open or renew whose request was first sent at ``sent_at``.

        Why the local deadline ``sent_at + ttl`` is never later than the registry's: the registry
        sets its deadline to ``now + ttl`` with ``now`` read on its own clock while it applies the
        call, which happens after we sent it (a replay with the same request id is answered with
        the first application's grant, and ``sent_at`` is the first send of that request id). Both
        deadlines are therefore the same duration, ``ttl``, counted from two events of which ours
        comes first; no timestamp crosses between the two hosts, so neither clock's offset nor a
        step of our wall clock matters (ours is monotonic). The one assumption is that the two
        clocks tick at the same rate over one ``ttl`` (quartz drifts ~1e-5; a registry host whose
        wall clock is stepped forward can expire leases early, which no holder can prevent).
        """
        if self.state is LeaseState.CLOSED or self.state is LeaseState.LOST:
            # Lost for good, including when the previous deadline passed while this call was
            # in flight (whether or not a dispatch looked): a late grant does not revive it.
            return
        deadline = sent_at + grant.ttl
        if self._keeper.clock() >= deadline:
            # The answer came after the deadline it grants: refusals may already have gone out.
            self._lose("local_deadline")
            return
        self._state = LeaseState.HELD
        self._deadline = deadline
        self._renewed_at = sent_at

    def _lose(self, reason: str) -> None:
        if self._state is LeaseState.LOST or self._state is LeaseState.CLOSED:
            return
        self._state = LeaseState.LOST
        self._reason = reason
        logger.warning(
            "lease lost; its Sessions are refused from now on and can only be closed",
            extra={"lease": self.lease_id, "owner": self._keeper.owner, "reason": reason},
        )
        self._keeper._emit(LeaseEventKind.LOST, self, reason=reason)

    def _close(self) -> None:
        self._state = LeaseState.CLOSED
