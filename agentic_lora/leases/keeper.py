"""The owner's half of a registry lease: :class:`LeaseKeeper` opens it, renews it in the
background, replaces a lost incarnation and closes it (see :mod:`agentic_lora.leases`).

Tests step time with an injected ``clock`` and ``sleep`` (see tests/leases/test_leases.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable
from collections.abc import Callable
from typing import Final
from typing import get_args

from tenacity import AsyncRetrying
from tenacity import RetryCallState
from tenacity import stop_after_attempt
from tenacity import wait_exponential
from tenacity.stop import stop_base

from agentic_lora.errors import ConfigurationError
from agentic_lora.errors import LeaseExpiredError
from agentic_lora.foundation.listeners import notify
from agentic_lora.foundation.replay import RegistryRetry
from agentic_lora.leases.call_replay import StopWhen
from agentic_lora.leases.call_replay import log_replay
from agentic_lora.leases.call_replay import replaying
from agentic_lora.leases.options import DEFAULT_LEASE_TTL
from agentic_lora.leases.options import LeaseSettings
from agentic_lora.leases.options import OnRestart
from agentic_lora.leases.options import check_lease_timing
from agentic_lora.leases.options import check_owner
from agentic_lora.leases.options import default_owner
from agentic_lora.leases.term import _HELD
from agentic_lora.leases.term import LeaseEvent
from agentic_lora.leases.term import LeaseEventKind
from agentic_lora.leases.term import LeaseListener
from agentic_lora.leases.term import LeaseState
from agentic_lora.leases.term import LeaseTerm
from agentic_lora.registry.api import RegistryAPI
from agentic_lora.registry.types import new_request_id

__all__ = ["LeaseKeeper"]

logger = logging.getLogger(__name__)

#: The registry's reason for a lease ended by a newer incarnation of the same owner.
_SUPERSEDED: Final = "owner_restarted"


class LeaseKeeper:
    """Holds one owner's registry lease for a rollout worker (see :mod:`agentic_lora.leases`).

    ``registry`` is any :class:`~agentic_lora.registry.api.RegistryAPI` (in-process or the Ray
    actor client). ``owner`` defaults to :func:`default_owner`. ``ttl`` (seconds, default 60) is
    what the registry waits after the last renewal before it expires the lease; ``renew_interval``
    defaults to ``ttl / 3``. ``registry_retry`` (a
    :class:`~agentic_lora.foundation.replay.RegistryRetry`) bounds the replays of one
    ``open_lease`` (a bind that cannot get a lease is refused with nothing sent, and the next one
    tries again) and of ``close_lease``, and its wait spaces every replay, renewals included
    (those are replayed until the local deadline); default: 4 attempts, an exponential wait from
    0.05 s up to ``min(2, renew_interval / 2)`` s. ``clock`` (monotonic seconds) and ``sleep``
    are injectable so tests step time deterministically.

    ``owner``, ``owner_configured``, ``ttl``, ``renew_interval``, ``on_restart`` and
    ``registry_retry`` are fixed for the keeper's life; the incarnation, lease id and state are
    those of :attr:`current`, the term new Sessions bind under (``keeper.current.lease_id``).
    """

    def __init__(
        self,
        registry: RegistryAPI,
        *,
        owner: str | None = None,
        ttl: float = DEFAULT_LEASE_TTL,
        renew_interval: float | None = None,
        on_restart: OnRestart = "release",
        registry_retry: RegistryRetry | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        check_lease_timing(ttl, renew_interval)
        if on_restart not in get_args(OnRestart):
            raise ConfigurationError(
                f"on_restart {on_restart!r} is not one of {list(get_args(OnRestart))}",
                check="on_restart",
            )
        self._registry = registry
        self.owner: Final = check_owner(owner if owner is not None else default_owner())
        #: False when the owner is the default ``hostname-pid`` (then only the TTL frees a dead
        #: worker's Sessions: no restart reuses the id).
        self.owner_configured: Final = owner is not None
        self.ttl: Final = float(ttl)
        self.renew_interval: Final = (
            float(renew_interval) if renew_interval is not None else ttl / 3
        )
        self.on_restart: Final[OnRestart] = on_restart
        # The default wait is bounded by half a renew interval, so the replays of a lost renewal
        # stay well inside one interval.
        self.registry_retry: Final = (
            registry_retry
            if registry_retry is not None
            else RegistryRetry(
                attempts=4,
                wait=wait_exponential(multiplier=0.05, max=min(2.0, self.renew_interval / 2)),
            )
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
        #: Told every :class:`~agentic_lora.leases.term.LeaseEvent` of this keeper's terms (opened,
        #: renewed, lost, closed, with the Sessions released or adopted); append any time.
        self.listeners: list[LeaseListener] = []

    @classmethod
    def from_settings(
        cls,
        settings: LeaseSettings,
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
    def current(self) -> LeaseTerm:
        """The incarnation new Sessions bind under (replaced once it is lost, see
        :mod:`agentic_lora.leases`)."""
        return self._term

    @property
    def superseded(self) -> bool:
        """True once a newer incarnation of this owner took over: this keeper never opens again."""
        return self._superseded

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
        last transport error when ``open_lease`` was not confirmed in ``registry_retry.attempts``
        tries (nothing is bound then; the next call tries again).
        """
        successors = 0
        while True:
            if self._closed or self._superseded:
                raise LeaseExpiredError(
                    f"the lease keeper of {self.owner!r} is "
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
                        f"no live lease for {self.owner!r} after {successors} incarnations",
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
                    request_id=new_request_id(), owner=self.owner, incarnation=lost.incarnation
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
                    "owner": self.owner,
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
                extra={"lease": lost.lease_id, "owner": self.owner},
            )

    def _retrying(self, stop: stop_base) -> AsyncRetrying:
        return replaying(stop, wait=self.registry_retry.wait, sleep=self._sleep)

    def _bounded(self) -> AsyncRetrying:
        """The replays of an ``open_lease`` or ``close_lease``: ``registry_retry.attempts``."""
        return self._retrying(stop_after_attempt(self.registry_retry.attempts))

    async def _open(self, term: LeaseTerm) -> None:
        request_id = new_request_id()  # every replay below reuses it
        sent_at: float | None = None
        try:
            async for attempt in self._bounded():
                with attempt:
                    if sent_at is None:
                        sent_at = self.clock()
                        term._sent = True
                    log_replay("open_lease", term.lease_id, attempt.retry_state)
                    grant = await self._registry.open_lease(
                        request_id=request_id,
                        owner=self.owner,
                        incarnation=term.incarnation,
                        ttl=self.ttl,
                        on_restart=self.on_restart,
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
                "owner": self.owner,
                "ttl": self.ttl,
                "released": len(grant.released),
                "adopted": len(grant.adopted),
            },
        )
        self._emit(LeaseEventKind.OPENED, term, released=grant.released, adopted=grant.adopted)
        if self._renewer is None and not self._closed:
            self._renewer = asyncio.get_running_loop().create_task(
                self._run(), name=f"renew lease {self.owner}"
            )
            self._renewer.add_done_callback(self._renewer_ended)
        self._wake.set()  # the renewer follows the new term

    # --- renewing ------------------------------------------------------------------------------

    def _touch(self, term: LeaseTerm) -> None:
        if term is not self._term or term._state is not _HELD or self._renewing:
            return
        # HELD always has a renewal time; an overdue one means the renewer's timer is late.
        if self.clock() - term._renewed_at >= self.renew_interval:
            self._wake.set()

    def _renewer_ended(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        # Only a bug (or an injected sleep that raises) gets here; the local deadline still
        # refuses every Session in time, but nothing renews any more: say so loudly.
        logger.error(
            "lease renewer stopped; the lease will be lost at its deadline",
            exc_info=task.exception(),
            extra={"lease": self._term.lease_id, "owner": self.owner},
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
            delay = term._renewed_at + self.renew_interval - self.clock()
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
            async for attempt in self._retrying(StopWhen(past_deadline)):
                with attempt:
                    if term.state is not LeaseState.HELD:
                        return  # lost (deadline) or replaced while we were retrying
                    if sent_at is None:
                        sent_at = self.clock()
                    log_replay("renew_lease", term.lease_id, attempt.retry_state)
                    grant = await self._registry.renew_lease(
                        request_id=request_id, owner=self.owner, incarnation=term.incarnation
                    )
        except LeaseExpiredError as exc:
            term._lose(str(exc.details.get("reason") or "expired"))
            return
        except Exception as exc:
            logger.warning(
                "lease renewal not confirmed before the local deadline",
                extra={"lease": term.lease_id, "owner": self.owner, "error": repr(exc)},
            )
            term._lose("renew_failed")
            return
        finally:
            self._renewing = False
        assert sent_at is not None
        term._granted(sent_at, grant)
        if term._state is LeaseState.HELD:
            self._emit(LeaseEventKind.RENEWED, term)

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
        notify(self.listeners, event, logger=logger, what="lease", extra={"lease": term.lease_id})

    # --- closing -------------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Stop renewing, then end the lease at the registry (``close_lease``): a clean shutdown
        leaves nothing to expire later. Sessions still bound under it are expired by that call,
        so close them first (:meth:`~agentic_lora.session.Versioning.aclose` does). A ``close_lease`` that is not confirmed is logged; the TTL then ends the lease.
        Idempotent; concurrent calls share one close."""
        if self._closing is None:
            self._closing = asyncio.get_running_loop().create_task(
                self._close(), name=f"close lease {self.owner}"
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
                async for attempt in self._bounded():
                    with attempt:
                        log_replay("close_lease", term.lease_id, attempt.retry_state)
                        released = await self._registry.close_lease(
                            request_id=request_id, owner=self.owner, incarnation=term.incarnation
                        )
            except Exception as exc:
                logger.warning(
                    "close_lease not confirmed; the lease ends with its TTL",
                    extra={"lease": term.lease_id, "owner": self.owner, "error": repr(exc)},
                )
        term._close()
        if released:
            logger.info(
                "lease closed with Sessions still on it; they are expired",
                extra={"lease": term.lease_id, "released": len(released)},
            )
        self._emit(LeaseEventKind.CLOSED, term, released=tuple(released))


def _retrieve(task: asyncio.Task[None]) -> None:
    # A shared open whose every waiter was cancelled still has its outcome read (no "never
    # retrieved" noise); the waiters that remain get it through shield.
    if not task.cancelled():
        with contextlib.suppress(BaseException):
            task.exception()
