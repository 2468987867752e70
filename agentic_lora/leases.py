"""Owner leases, client side: the Sessions a rollout worker binds stay held while, and only while,
that worker is alive.

Every Session ref hangs on its owner's registry lease (``open_lease`` / ``renew_lease`` /
``close_lease``; the registry side is :class:`~agentic_lora.registry.core.RegistryCore`). A worker
that dies stops renewing; once the TTL passed, the registry's sweeper expires the lease and
releases the refs, so a retired version can be reclaimed. A :class:`LeaseKeeper` is the owner's
half: one per :class:`~agentic_lora.session.Versioning`, i.e. one per rollout worker process.

One incarnation's lease, as this process sees it (a :class:`LeaseTerm`)::

    PENDING --open granted--> HELD --local deadline passed, or the registry said LEASE_EXPIRED--> LOST
       |                        \\----------------------------aclose: close_lease-------------> CLOSED
       \\--the registry refused the open (LEASE_EXPIRED)--> LOST

* **Owner and incarnation.** ``owner`` names the worker *slot* and should be stable across restarts
  of that slot (``"rollout-worker-3"``; flag ``--versioned-lora-owner-id``). The incarnation is
  minted per process start (uuid4 hex). When a new incarnation of a known owner opens its lease,
  the registry ends the predecessor's at once: with ``on_restart="release"`` (rollout workers) its
  Sessions are expired and their refs released without waiting for the TTL; with ``"adopt"`` (the
  gateway, whose agents outlive it) they move to the new lease. Without a configured owner the
  default is ``f"{hostname}-{pid}"``, which no restart ever reuses: a dead worker's Sessions are
  then released by the TTL only (``ttl`` plus the registry's sweep interval). Owner ids must be
  unique among live processes.
* **Lazy.** Constructing a keeper does no I/O; the first Session bind opens the lease.
* **Renewal.** A background task renews every ``renew_interval`` (default ``ttl / 3``) whether or
  not Sessions dispatch, so an idle worker keeps its Sessions. Every dispatch marks the lease in use
  (:meth:`LeaseTerm.touch`) and, if the last successful renewal is older than ``renew_interval``
  (a late timer, a stalled event loop), wakes the renewer at once. A dispatch never waits for a
  renewal and never makes a registry call of its own.
* **Failed renewals** (registry unreachable, reply lost) are replayed with the same request id,
  which the registry answers from its memory, until the local deadline; then the lease is LOST.
* **Local deadline.** The keeper decides on its own clock (``time.monotonic``) whether its lease
  still holds: ``ttl`` after it *sent* the last successful open or renew (``LeaseTerm._granted``
  argues why that deadline is never later than the registry's).
* **Lost is for good.** A Session bound under a lost lease is refused at every dispatch with
  :class:`~agentic_lora.errors.SessionExpiredError` (``SESSION_EXPIRED``, nothing sent) and can
  only be closed: its ref may already be released, and its version reclaimed. *New* Sessions keep
  working: the next bind mints a fresh incarnation and opens a new lease (with ``"release"`` that
  also ends the lost one at the registry at once, if it still held it). One exception: a keeper
  whose lease was ended because a newer incarnation of its owner opened one (the registry's reason
  ``owner_restarted``: this process was partitioned or hung while its slot was restarted) never
  opens again, because reopening would end the newer process's lease and expire *its* Sessions.
  After a purely local loss the keeper first asks the registry (one ``renew_lease``) whether that
  happened, before it reopens. With ``on_restart="adopt"`` a reopened incarnation adopts whatever
  the lost lease still held; the gateway re-attaches those Sessions by name.
* **What a keeper cannot see.** A process whose lease the registry ended (a restart of its slot
  elsewhere, or expiry after a pause the process did not notice) learns it at its next renewal, at
  most ``renew_interval`` later; until then its bound Sessions still dispatch (the dispatch guard
  still refuses any request for a version that is being reclaimed).

Tests step time with an injected ``clock`` and ``sleep`` (see tests/test_leases.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import math
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Literal, get_args

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential,
)
from tenacity.stop import stop_base
from tenacity.wait import wait_base

from agentic_lora.errors import (
    ConfigurationError,
    LeaseExpiredError,
    SessionExpiredError,
)
from agentic_lora.registry.api import RegistryAPI
from agentic_lora.registry.types import LeaseGrant, new_request_id
from agentic_lora.replay import is_lost_reply

if TYPE_CHECKING:
    from agentic_lora.config import AgenticLoRASettings

__all__ = [
    "DEFAULT_LEASE_TTL",
    "LeaseEvent",
    "LeaseEventKind",
    "LeaseKeeper",
    "LeaseListener",
    "LeaseState",
    "LeaseTerm",
    "OnRestart",
    "default_owner",
]

logger = logging.getLogger(__name__)

#: What a new incarnation does with its predecessor's Sessions (see module docstring).
OnRestart = Literal["release", "adopt"]

#: Seconds. Minutes-scale, not hours: a dead worker's refs are released within about a minute.
DEFAULT_LEASE_TTL: Final = 60.0

#: The registry's reason for a lease ended by a newer incarnation of the same owner.
_SUPERSEDED: Final = "owner_restarted"

_MAX_OWNER = 200  # the registry takes 256 for a token; leave room in the lease id


class LeaseState(enum.StrEnum):
    """Where one incarnation's lease is (see the module docstring's diagram)."""

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


def default_owner() -> str:
    """``"<hostname>-<pid>"``: unique per process, so a restart never releases its predecessor."""
    return f"{socket.gethostname()}-{os.getpid()}"


def check_owner(owner: object) -> str:
    """``owner`` if it is a usable owner id; else ConfigurationError (check ``owner_id``)."""
    if (
        not isinstance(owner, str)
        or not owner
        or len(owner) > _MAX_OWNER
        or not owner.isprintable()
        or any(c.isspace() for c in owner)
    ):
        raise ConfigurationError(
            f"owner id {owner!r} must be a printable string of 1-{_MAX_OWNER} characters "
            "without whitespace",
            check="owner_id",
        )
    return owner


def check_lease_timing(ttl: object, renew_interval: object) -> None:
    """ttl > 0 and 0 < renew_interval < ttl (None: ttl / 3); else ConfigurationError (``lease``)."""
    if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not 0 < ttl < float("inf"):
        raise ConfigurationError(
            f"lease ttl {ttl!r} must be a finite number of seconds above 0", check="lease"
        )
    if renew_interval is None:
        return
    if (
        isinstance(renew_interval, bool)
        or not isinstance(renew_interval, int | float)
        or not 0 < renew_interval < ttl
    ):
        raise ConfigurationError(
            f"lease renew interval {renew_interval!r} must be above 0 and below the ttl {ttl}: "
            "a lease renewed no more often than it expires is lost between two renewals",
            check="lease",
        )


class LeaseTerm:
    """One incarnation's lease as this process sees it; a Session keeps the one it bound under."""

    def __init__(self, keeper: LeaseKeeper, incarnation: str) -> None:
        self._keeper = keeper
        self._incarnation = incarnation
        self._lease_id = f"{keeper.owner}/{incarnation}"
        self._state = LeaseState.PENDING
        # Set by the first grant; only read while HELD (the hot path compares floats directly).
        self._deadline = math.inf
        self._renewed_at = -math.inf
        self._reason: str | None = None
        self._opening: asyncio.Task[None] | None = None
        # An open_lease for it may have reached the registry: close_lease is owed at shutdown.
        self._sent = False

    @property
    def incarnation(self) -> str:
        return self._incarnation

    @property
    def lease_id(self) -> str:
        """``"<owner>/<incarnation>"``, the id Sessions bind under."""
        return self._lease_id

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
        return f"LeaseTerm({self._lease_id!r}, {self._state.value})"

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
            f"session {session or '?'}: lease {self._lease_id!r} is {state.value} ({reason}); "
            "nothing was sent, the Session can only be closed",
            session=session,
            lease=self._lease_id,
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
            extra={"lease": self._lease_id, "owner": self._keeper.owner, "reason": reason},
        )
        self._keeper._emit(LeaseEventKind.LOST, self, reason=reason)

    def _close(self) -> None:
        self._state = LeaseState.CLOSED


class LeaseKeeper:
    """Holds one owner's registry lease for a rollout worker (see module docstring).

    ``registry`` is any :class:`~agentic_lora.registry.api.RegistryAPI` (in-process or the Ray
    actor client). ``owner`` defaults to :func:`default_owner`. ``ttl`` (seconds, default 60) is
    what the registry waits after the last renewal before it expires the lease; ``renew_interval``
    defaults to ``ttl / 3``. ``open_attempts`` bounds the replays of one ``open_lease`` (a bind
    that cannot get a lease is refused with nothing sent, and the next one tries again) and of
    ``close_lease``; renewals are replayed until the local deadline. ``clock`` (monotonic seconds)
    and ``sleep`` are injectable so tests step time deterministically.
    """

    def __init__(
        self,
        registry: RegistryAPI,
        *,
        owner: str | None = None,
        ttl: float = DEFAULT_LEASE_TTL,
        renew_interval: float | None = None,
        on_restart: OnRestart = "release",
        open_attempts: int = 4,
        retry_wait: wait_base | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        check_lease_timing(ttl, renew_interval)
        if on_restart not in get_args(OnRestart):
            raise ConfigurationError(
                f"on_restart {on_restart!r} is not one of {list(get_args(OnRestart))}",
                check="on_restart",
            )
        if open_attempts < 1:
            raise ConfigurationError("open_attempts must be at least 1", check="open_attempts")
        self._registry = registry
        self._owner_given = owner is not None
        self._owner = check_owner(owner if owner is not None else default_owner())
        self._ttl = float(ttl)
        self._renew_interval = float(renew_interval) if renew_interval is not None else ttl / 3
        self._on_restart: OnRestart = on_restart
        self._open_attempts = open_attempts
        self._retry_wait = (
            retry_wait
            if retry_wait is not None
            else wait_exponential(multiplier=0.05, max=min(2.0, self._renew_interval / 2))
        )
        self.clock = clock
        self._sleep = sleep
        self._term = LeaseTerm(self, uuid.uuid4().hex)
        self._terms_opened = 0
        self._superseded = False
        self._renewer: asyncio.Task[None] | None = None
        self._renewing = False
        self._wake = asyncio.Event()
        self._closed = False
        self._closing: asyncio.Task[None] | None = None
        self._last_used: float | None = None
        self._listeners: list[LeaseListener] = []

    @classmethod
    def from_settings(
        cls,
        settings: AgenticLoRASettings,
        registry: RegistryAPI,
        *,
        owner: str | None = None,
        on_restart: OnRestart = "release",
    ) -> LeaseKeeper:
        """A keeper with the settings' ``owner_id`` (unless ``owner`` is given), ``lease_ttl``
        and ``lease_renew_interval``."""
        return cls(
            registry,
            owner=owner if owner is not None else settings.owner_id,
            ttl=settings.lease_ttl,
            renew_interval=settings.lease_renew_interval,
            on_restart=on_restart,
        )

    # --- what it is --------------------------------------------------------------------------

    @property
    def owner(self) -> str:
        return self._owner

    @property
    def owner_configured(self) -> bool:
        """False when the owner is the default ``hostname-pid`` (then only the TTL frees a dead
        worker's Sessions: no restart reuses the id)."""
        return self._owner_given

    @property
    def ttl(self) -> float:
        return self._ttl

    @property
    def renew_interval(self) -> float:
        return self._renew_interval

    @property
    def on_restart(self) -> OnRestart:
        return self._on_restart

    @property
    def current(self) -> LeaseTerm:
        """The incarnation new Sessions bind under (replaced once it is lost, see module doc)."""
        return self._term

    @property
    def incarnation(self) -> str:
        return self._term.incarnation

    @property
    def lease_id(self) -> str:
        return self._term.lease_id

    @property
    def state(self) -> LeaseState:
        return self._term.state

    @property
    def superseded(self) -> bool:
        """True once a newer incarnation of this owner took over: this keeper never opens again."""
        return self._superseded

    @property
    def last_used(self) -> float | None:
        """When a dispatch last used the lease, on the keeper's clock."""
        return self._last_used

    @property
    def closed(self) -> bool:
        return self._closed

    def add_listener(self, listener: LeaseListener) -> None:
        self._listeners.append(listener)

    def check(self) -> None:
        """Raise SessionExpiredError unless the current incarnation's lease holds (no I/O)."""
        self._term.check()

    def touch(self) -> None:
        """Mark the current lease in use (see :meth:`LeaseTerm.touch`)."""
        self._touch(self._term)

    def __repr__(self) -> str:
        return f"LeaseKeeper({self._term.lease_id!r}, {self._term.state.value})"

    # --- acquiring -----------------------------------------------------------------------------

    async def acquire(self) -> LeaseTerm:
        """The live lease to bind a new Session under, opening it (or a fresh incarnation after
        a loss) if needed. Concurrent callers share one ``open_lease``.

        Raises LeaseExpiredError once closed or superseded; a typed registry error as is; and the
        last transport error when ``open_lease`` was not confirmed in ``open_attempts`` tries
        (nothing is bound then; the next call tries again).
        """
        successors = 0
        while True:
            if self._closed or self._superseded:
                raise LeaseExpiredError(
                    f"the lease keeper of {self._owner!r} is "
                    f"{'closed' if self._closed else 'superseded by a newer incarnation'}",
                    lease=self._term.lease_id,
                    reason="closed" if self._closed else _SUPERSEDED,
                )
            term = self._term
            state = term.state
            if state is LeaseState.HELD:
                return term
            if state is not LeaseState.PENDING:
                # A fresh incarnation is refused only if it was opened before and died (a lost
                # reply, then a whole TTL): bounded anyway, never a loop against the registry.
                successors += 1
                if successors > 3:
                    raise LeaseExpiredError(
                        f"no live lease for {self._owner!r} after {successors} incarnations",
                        lease=term.lease_id,
                        reason=term.lost_reason,
                    )
                await self._successor_of(term)
                continue
            task = term._opening
            if task is None or task.done():
                # No await since the state check: concurrent first binds share this one task.
                task = asyncio.get_running_loop().create_task(
                    self._open(term), name=f"open lease {term.lease_id}"
                )
                task.add_done_callback(_retrieve)
                term._opening = task
            try:
                # shield: a cancelled bind leaves the shared open running for the others.
                await asyncio.shield(task)
            except LeaseExpiredError:
                continue  # this incarnation is already dead at the registry: the next one

    async def _successor_of(self, lost: LeaseTerm) -> None:
        """Replace a lost term with a fresh incarnation, unless a newer process took the owner."""
        if lost.lost_reason in ("local_deadline", "renew_failed"):
            # Lost on our side only: the registry may have ended it because a newer incarnation
            # of this owner opened meanwhile (we were partitioned). Reopening would end *that*
            # process's lease, so ask first. A transport error propagates: try again later.
            try:
                await self._registry.renew_lease(
                    request_id=new_request_id(), owner=self._owner, incarnation=lost.incarnation
                )
            except LeaseExpiredError as exc:
                if exc.details.get("reason") == _SUPERSEDED:
                    self._supersede(lost)
                    return
        elif lost.lost_reason == _SUPERSEDED:
            self._supersede(lost)
            return
        if self._term is lost:  # another caller may have replaced it during the await
            self._term = LeaseTerm(self, uuid.uuid4().hex)
            logger.warning(
                "lease lost; new Sessions bind under a new incarnation",
                extra={
                    "lease": lost.lease_id,
                    "owner": self._owner,
                    "incarnation": self._term.incarnation,
                    "reason": lost.lost_reason,
                },
            )

    def _supersede(self, lost: LeaseTerm) -> None:
        if not self._superseded:
            self._superseded = True
            logger.error(
                "a newer incarnation of this owner holds its lease; this process opens no new "
                "Sessions (is the worker slot running twice?)",
                extra={"lease": lost.lease_id, "owner": self._owner},
            )

    def _retrying(self, stop: stop_base) -> AsyncRetrying:
        return AsyncRetrying(
            stop=stop,
            wait=self._retry_wait,
            retry=retry_if_exception(is_lost_reply),
            sleep=self._sleep,
            reraise=True,
        )

    async def _open(self, term: LeaseTerm) -> None:
        request_id = new_request_id()  # every replay below reuses it
        sent_at: float | None = None
        try:
            async for attempt in self._retrying(stop_after_attempt(self._open_attempts)):
                with attempt:
                    if sent_at is None:
                        sent_at = self.clock()
                        term._sent = True
                    self._log_replay("open_lease", term, attempt.retry_state)
                    grant = await self._registry.open_lease(
                        request_id=request_id,
                        owner=self._owner,
                        incarnation=term.incarnation,
                        ttl=self._ttl,
                        on_restart=self._on_restart,
                    )
        except LeaseExpiredError as exc:
            term._lose(str(exc.details.get("reason") or "expired"))
            raise
        assert sent_at is not None
        term._granted(sent_at, grant)
        self._terms_opened += 1
        logger.info(
            "lease opened",
            extra={
                "lease": term.lease_id,
                "owner": self._owner,
                "ttl": self._ttl,
                "released": len(grant.released),
                "adopted": len(grant.adopted),
            },
        )
        self._emit(LeaseEventKind.OPENED, term, released=grant.released, adopted=grant.adopted)
        if self._renewer is None and not self._closed:
            self._renewer = asyncio.get_running_loop().create_task(
                self._run(), name=f"renew lease {self._owner}"
            )
            self._renewer.add_done_callback(self._renewer_ended)
        self._wake.set()  # the renewer follows the new term

    # --- renewing ------------------------------------------------------------------------------

    def _touch(self, term: LeaseTerm) -> None:
        now = self.clock()
        self._last_used = now
        if term is not self._term or term._state is not _HELD or self._renewing:
            return
        # HELD always has a renewal time; an overdue one means the renewer's timer is late.
        if now - term._renewed_at >= self._renew_interval:
            self._wake.set()

    def _renewer_ended(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        # Only a bug (or an injected sleep that raises) gets here; the local deadline still
        # refuses every Session in time, but nothing renews any more: say so loudly.
        logger.error(
            "lease renewer stopped; the lease will be lost at its deadline",
            exc_info=task.exception(),
            extra={"lease": self._term.lease_id, "owner": self._owner},
        )

    async def _run(self) -> None:
        # One task per keeper, from the first grant until aclose. It only ever renews the
        # current term; a lost term waits here for the next grant to wake it.
        while not self._closed:
            term = self._term
            if term.state is not LeaseState.HELD:
                await self._wake.wait()
                self._wake.clear()
                continue
            delay = term._renewed_at + self._renew_interval - self.clock()
            if delay > 0:
                await self._nap(delay)
                continue
            await self._renew(term)

    async def _nap(self, delay: float) -> None:
        """Sleep ``delay`` on the injected sleep, or less if woken (a dispatch, a new term)."""
        if self._wake.is_set():
            self._wake.clear()
            return
        sleeper = asyncio.ensure_future(self._sleep(delay))
        waker = asyncio.ensure_future(self._wake.wait())
        try:
            await asyncio.wait((sleeper, waker), return_when=asyncio.FIRST_COMPLETED)
        finally:
            # Not awaited: this also runs when the renewer itself is cancelled or torn down.
            sleeper.cancel()
            waker.cancel()
        self._wake.clear()

    async def _renew(self, term: LeaseTerm) -> None:
        request_id = new_request_id()  # one round: every replay reuses it
        sent_at: float | None = None

        def past_deadline(state: RetryCallState) -> bool:
            # Give up once the next try could only land after the local deadline: a renewal
            # then cannot revive the lease (lost is for good), it would only mislead.
            return self.clock() + (state.upcoming_sleep or 0.0) >= term._deadline

        self._renewing = True
        try:
            async for attempt in self._retrying(_StopWhen(past_deadline)):
                with attempt:
                    if term.state is not LeaseState.HELD:
                        return  # lost (deadline) or replaced while we were retrying
                    if sent_at is None:
                        sent_at = self.clock()
                    self._log_replay("renew_lease", term, attempt.retry_state)
                    grant = await self._registry.renew_lease(
                        request_id=request_id, owner=self._owner, incarnation=term.incarnation
                    )
        except LeaseExpiredError as exc:
            term._lose(str(exc.details.get("reason") or "expired"))
            return
        except Exception as exc:
            logger.warning(
                "lease renewal not confirmed before the local deadline",
                extra={"lease": term.lease_id, "owner": self._owner, "error": repr(exc)},
            )
            term._lose("renew_failed")
            return
        finally:
            self._renewing = False
        assert sent_at is not None
        term._granted(sent_at, grant)
        if term._state is LeaseState.HELD:
            self._emit(LeaseEventKind.RENEWED, term)

    def _log_replay(self, verb: str, term: LeaseTerm, state: RetryCallState) -> None:
        if state.attempt_number > 1:
            logger.warning(
                "replaying lease call with the same request id",
                extra={"verb": verb, "lease": term.lease_id, "attempt": state.attempt_number},
            )

    def _emit(
        self,
        kind: LeaseEventKind,
        term: LeaseTerm,
        *,
        reason: str | None = None,
        released: tuple[str, ...] = (),
        adopted: tuple[str, ...] = (),
    ) -> None:
        event = LeaseEvent(kind, term.lease_id, self.clock(), reason, released, adopted)
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:
                logger.exception("lease listener failed", extra={"lease": term.lease_id})

    # --- closing -------------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Stop renewing, then end the lease at the registry (``close_lease``): a clean shutdown
        leaves nothing to expire later. Sessions still bound under it are expired by that call,
        so close them first (:meth:`~agentic_lora.session.Versioning.aclose` does). A ``close_lease`` that is not confirmed is logged; the TTL then ends the lease.
        Idempotent; concurrent calls share one close."""
        if self._closing is None:
            self._closing = asyncio.get_running_loop().create_task(
                self._close(), name=f"close lease {self._owner}"
            )
        await asyncio.shield(self._closing)

    async def _close(self) -> None:
        self._closed = True  # from here on acquire refuses and the renewer stops
        term = self._term
        for task in (self._renewer, term._opening):
            if task is not None and not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._renewer = None
        released: tuple[str, ...] = ()
        if term._sent and term._state is not LeaseState.CLOSED and not self._superseded:
            request_id = new_request_id()
            try:
                async for attempt in self._retrying(stop_after_attempt(self._open_attempts)):
                    with attempt:
                        self._log_replay("close_lease", term, attempt.retry_state)
                        released = await self._registry.close_lease(
                            request_id=request_id, owner=self._owner, incarnation=term.incarnation
                        )
            except Exception as exc:
                logger.warning(
                    "close_lease not confirmed; the lease ends with its TTL",
                    extra={"lease": term.lease_id, "owner": self._owner, "error": repr(exc)},
                )
        term._close()
        if released:
            logger.info(
                "lease closed with Sessions still on it; they are expired",
                extra={"lease": term.lease_id, "released": len(released)},
            )
        self._emit(LeaseEventKind.CLOSED, term, released=tuple(released))


class _StopWhen(stop_base):
    """A tenacity stop from a predicate (stop_base has no such factory)."""

    def __init__(self, predicate: Callable[[RetryCallState], bool]) -> None:
        self._predicate = predicate

    def __call__(self, retry_state: RetryCallState) -> bool:
        return self._predicate(retry_state)


def _retrieve(task: asyncio.Task[None]) -> None:
    # A shared open whose every waiter was cancelled still has its outcome read (no "never
    # retrieved" noise); the waiters that remain get it through shield.
    if not task.cancelled():
        with contextlib.suppress(BaseException):
            task.exception()
