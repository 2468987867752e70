"""Binders: what a Session does with the registry before a send and after its close.

A Session holds one :class:`SessionBinder`. Pass-through Sessions (the framework flag off) hold
:data:`PASS_THROUGH`, which binds nothing, validates nothing and sends every body as the caller
gave it. Versioned Sessions hold a :class:`RegistryBinder`: it checks the route once (the engine
dialect's rule, before the bind, so a request the engine cannot serve never binds the Session),
binds once at the first generation, keeps the owner lease, checks staleness, and at close tells
the registry ``begin_close``, waits for the bind task and ``release``\\s exactly once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from collections.abc import Callable
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from typing import NamedTuple
from typing import Protocol
from typing import TypeVar

from agentic_lora.engines.dialect import EngineDialect
from agentic_lora.engines.transport import EngineReply
from agentic_lora.errors import AgenticLoRAError
from agentic_lora.errors import InvalidRequestError
from agentic_lora.errors import LeaseExpiredError
from agentic_lora.errors import RequestRefusedError
from agentic_lora.errors import SessionExpiredError
from agentic_lora.errors import SessionReleaseError
from agentic_lora.errors import VersionTooStaleError
from agentic_lora.foundation.replay import RegistryRetry
from agentic_lora.foundation.requests import Route
from agentic_lora.foundation.requests import new_rid
from agentic_lora.leases import LeaseKeeper
from agentic_lora.leases import LeaseTerm
from agentic_lora.registry.api import RegistryAPI
from agentic_lora.registry.provenance import DefaultRevisionReader
from agentic_lora.registry.provenance import StalenessListener
from agentic_lora.registry.provenance import TurnProvenance
from agentic_lora.registry.provenance import version_lag
from agentic_lora.registry.types import Binding
from agentic_lora.registry.types import ReleaseResult

__all__ = ["PASS_THROUGH", "BinderConfig", "PassThroughBinder", "RegistryBinder", "SessionBinder"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


class Turn(NamedTuple):
    """One versioned dispatch: the bound version and its lag when the dispatch started.

    A named tuple: made once per dispatch, and a tuple is built in one step where a frozen
    dataclass sets each field through ``object.__setattr__``."""

    binding: Binding
    lag: int | None


class SessionBinder(Protocol):
    """A Session's registry side (see module docstring)."""

    @property
    def validate(self) -> bool:
        """Whether request bodies are shape-checked (:func:`~agentic_lora.foundation.requests.check_shape`)
        before the send."""
        ...

    @property
    def binding(self) -> Binding | None:
        """The bound version (None before the first bind, and always when passing through)."""
        ...

    @property
    def lease(self) -> LeaseTerm | None:
        """The owner lease binds run under (None: lease-free)."""
        ...

    @property
    def ready(self) -> bool:
        """True when :meth:`turn` may stand for :meth:`before_send` (nothing left to await)."""
        ...

    def turn(self, route: Route, body: dict[str, Any]) -> Turn | None:
        """:meth:`before_send` without the bind, for a binder that is :attr:`ready`."""
        ...

    async def before_send(
        self, route: Route, body: dict[str, Any], still_open: Callable[[], None]
    ) -> Turn | None:
        """Everything before the chain: may bind (once), may refuse; may set ``body["rid"]``.
        ``still_open`` raises if the Session started closing meanwhile."""
        ...

    def after_reply(self, reply: EngineReply, turn: Turn | None) -> EngineReply:
        """The reply as the caller gets it (with provenance when versioned)."""
        ...

    def provenance(self, session_id: str) -> dict[str, Any]:
        """The trajectory's provenance (see :meth:`agentic_lora.session.Session.provenance`)."""
        ...

    async def begin_close(self) -> None:
        """Make a late bind impossible (SessionReleaseError if not confirmed)."""
        ...

    async def settle_bind(self) -> None:
        """Wait for a bind still in flight, never cancelling it."""
        ...

    def bind_settled(self) -> bool:
        """True when no bind is in flight (then :meth:`settle_bind` would not wait)."""
        ...

    async def release(self) -> ReleaseResult | None:
        """Drop the Session's ref, exactly once (SessionReleaseError if not confirmed)."""
        ...


class PassThroughBinder:
    """The null binder: no registry, no binding, bodies untouched (the feature flag off)."""

    validate = False
    binding = None
    lease = None
    ready = True

    def turn(self, route: Route, body: dict[str, Any]) -> None:
        return None

    async def before_send(
        self, route: Route, body: dict[str, Any], still_open: Callable[[], None]
    ) -> None:
        return None

    def after_reply(self, reply: EngineReply, turn: Turn | None) -> EngineReply:
        return reply

    def provenance(self, session_id: str) -> dict[str, Any]:
        return _provenance(session_id, None, [], None)

    async def begin_close(self) -> None:
        return None

    async def settle_bind(self) -> None:
        return None

    def bind_settled(self) -> bool:
        return True

    async def release(self) -> None:
        return None


#: Stateless, so every pass-through Session shares it.
PASS_THROUGH = PassThroughBinder()


def _bound_already() -> None:
    """What a binder's ``on_bound`` becomes once it was told (see ``RegistryBinder._bind_once``)."""


def _provenance(
    session_id: str, b: Binding | None, lags: list[int | None], too_stale: int | None
) -> dict[str, Any]:
    return {
        "session_id": session_id,
        "version_id": b.version_id if b is not None else None,
        "digest": b.digest if b is not None else None,
        "lora_name": b.lora_name if b is not None else None,
        "default_revision_at_bind": b.default_revision if b is not None else None,
        "rolled_back_from": b.rolled_back_from if b is not None else None,
        "lags": list(lags),
        "turns": len(lags),
        "too_stale_lag": too_stale,
    }


@dataclass(frozen=True, slots=True)
class BinderConfig:
    """What every versioned Session of one Versioning shares.

    No defaults: the Versioning sets every field (a forgotten one must not pass as "off"). None
    means no lease, no staleness bound, no revision reader.
    """

    registry: RegistryAPI
    dialect: EngineDialect
    retry: RegistryRetry
    lease: LeaseKeeper | None
    max_version_lag: int | None
    revision: DefaultRevisionReader | None
    staleness: Sequence[StalenessListener]


class RegistryBinder:
    """A versioned Session's binder: bind once, keep the lease, check staleness, release once."""

    def __init__(self, key: str, config: BinderConfig, on_bound: Callable[[], None]) -> None:
        self._key = key
        self._cfg = config
        # Told once the registry confirmed the bind, inside the bind task itself: the Session
        # turns BOUND even when every waiter of the bind was cancelled meanwhile.
        self._on_bound = on_bound
        self._binding: Binding | None = None
        self._bind_task: asyncio.Task[Binding] | None = None
        # The lease of this Session's first bind attempt, kept for life (see module docstring
        # of agentic_lora.session).
        self._term: LeaseTerm | None = None
        # One idempotency key per registry verb for this lifecycle: every replay reuses it. The
        # close's keys are minted at its first call (a close done in one step needs none).
        self._bind_request_id = new_rid()
        self._close_request_ids: tuple[str, str] | None = None
        # The lag of every turn that returned a reply, in the order the replies came back.
        self._lags: list[int | None] = []
        # The lag of the first VERSION_TOO_STALE refusal; once set, every dispatch is refused.
        self._too_stale: int | None = None
        # The last turn's provenance, reused while the lag stays the same (the binding never
        # changes once set, so only the lag can differ between turns).
        self._turn: TurnProvenance | None = None

    validate = True

    @property
    def binding(self) -> Binding | None:
        return self._binding

    @property
    def lease(self) -> LeaseTerm | None:
        return self._term

    # --- before the send -------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        # Bound: every later turn is checked and numbered without an await.
        return self._binding is not None

    def _check_request(self, route: Route, body: dict[str, Any]) -> None:
        # Before the bind, and the only route check of the request: a request the engine cannot
        # serve must not bind the Session.
        self._cfg.dialect.check_route(route)
        if body.get("stream"):
            # A reply read whole cannot be handed on chunk by chunk: streams go through
            # Session.stream, which asks the engine for the stream itself.
            raise InvalidRequestError(
                "stream=true needs Session.stream (dispatch reads one whole reply)",
                route=route.value,
                reason="stream",
            )

    def turn(self, route: Route, body: dict[str, Any]) -> Turn:
        binding = self._binding
        assert binding is not None
        self._check_request(route, body)
        return self._start_turn(binding, body)

    async def before_send(
        self, route: Route, body: dict[str, Any], still_open: Callable[[], None]
    ) -> Turn:
        binding = self._binding
        if binding is not None:
            return self.turn(route, body)
        self._check_request(route, body)
        term = self._term
        if term is not None:
            # Before the bind and any engine call: a Session whose lease is lost sends nothing
            # (its ref may be released and its version reclaimed already).
            term.check(session=self._key)
        binding = await self._bound()
        # Close may have started while this request waited for the bind.
        still_open()
        return self._start_turn(binding, body)

    def _start_turn(self, binding: Binding, body: dict[str, Any]) -> Turn:
        term = self._term
        if term is not None:
            # Before any engine call, and after the bind (or the wait for it), which may have
            # outlasted the lease: a Session whose lease is lost sends nothing.
            term.check(session=self._key)
            term.touch()
        # Only here, at the start of a dispatch: a generation already running is never cut by a
        # publication that lands while it runs (its reply still comes back).
        lag = self._check_lag(binding)
        if body.get("rid") is None:
            body["rid"] = new_rid()
        return Turn(binding, lag)

    def after_reply(self, reply: EngineReply, turn: Turn | None) -> EngineReply:
        assert turn is not None
        provenance = self._turn
        if provenance is None or provenance.lag != turn.lag:
            provenance = self._turn = TurnProvenance.of(turn.binding, turn.lag)
        self._lags.append(turn.lag)
        return reply.with_provenance(provenance)

    def provenance(self, session_id: str) -> dict[str, Any]:
        return _provenance(session_id, self._binding, self._lags, self._too_stale)

    async def _lease_for_bind(self) -> LeaseTerm | None:
        keeper = self._cfg.lease
        if keeper is None:
            return None
        term = self._term
        if term is None:
            try:
                term = await keeper.acquire()
            except LeaseExpiredError as exc:
                raise SessionExpiredError(
                    f"session {self._key!r}: no owner lease to bind under ({exc.message}); "
                    "nothing was sent",
                    session=self._key,
                    lease=exc.details.get("lease"),
                    reason=exc.details.get("reason"),
                ) from exc
            except AgenticLoRAError:
                raise
            except Exception as exc:
                raise RequestRefusedError(
                    f"session {self._key!r}: its owner lease was not confirmed ({exc!r}); "
                    "nothing was sent to an engine, and the next generation tries again",
                    session=self._key,
                    stage="lease",
                ) from exc
            # Kept for life from here on: the bind below may apply even if its reply is lost,
            # and then the registry holds the ref under this lease, so every replay must name it.
            self._term = term
        term.check(session=self._key)
        return term

    async def _bind_once(self) -> Binding:
        registry = self._cfg.registry
        term = await self._lease_for_bind()
        try:
            if term is None:
                binding = await registry.bind_first(
                    request_id=self._bind_request_id, session_key=self._key
                )
            else:
                binding = await registry.bind_first(
                    request_id=self._bind_request_id, session_key=self._key, lease=term.lease_id
                )
        except LeaseExpiredError as exc:
            # The registry ended the lease first, so nothing was bound under it; the lease stays
            # lost for good and so does this Session (its replays must name the same lease).
            assert term is not None
            term.mark_lost(str(exc.details.get("reason") or "expired"))
            raise SessionExpiredError(
                f"session {self._key!r}: lease {term.lease_id!r} ended before the bind; "
                "nothing was sent, the Session can only be closed",
                session=self._key,
                lease=term.lease_id,
                reason=term.lost_reason,
            ) from exc
        except AgenticLoRAError:
            raise
        except Exception as exc:
            raise RequestRefusedError(
                f"session {self._key!r}: the binding was not confirmed ({exc!r}); nothing was "
                "sent to an engine, and the next generation replays the same bind",
                session=self._key,
                stage="bind",
            ) from exc
        self._binding = binding
        on_bound = self._on_bound
        # Told once (a Session binds once), then dropped: the callback is the Session's own
        # method, and without it a bound Session and its binder form no reference cycle, so
        # they are freed as soon as the last reference goes, not by a garbage-collector pass.
        self._on_bound = _bound_already
        on_bound()
        if logger.isEnabledFor(logging.INFO):  # the extra dict is not built for nobody
            logger.info(
                "session bound",
                extra={
                    "session": self._key,
                    "version": binding.version_id,
                    "lora_name": binding.lora_name,
                },
            )
        return binding

    async def _bound(self) -> Binding:
        if self._binding is not None:
            return self._binding
        task = self._bind_task
        if task is None or (task.done() and (task.cancelled() or task.exception() is not None)):
            # No await between this check and the assignment: concurrent first generations
            # all see the same task, so there is exactly one bind in flight per Session.
            task = asyncio.get_running_loop().create_task(
                self._bind_once(), name=f"bind {self._key}"
            )
            self._bind_task = task
        # shield: a waiter cancelled here leaves the shared bind running for the others.
        binding = await asyncio.shield(task)
        if self._bind_task is task:
            # Bound for good (the next turn returns above): an open Session keeps no finished
            # task, which would hold several hundred bytes per Session for its whole life.
            self._bind_task = None
        return binding

    def _check_lag(self, binding: Binding) -> int | None:
        cfg = self._cfg
        reader = cfg.revision
        lag = version_lag(binding, reader.default_revision() if reader is not None else None)
        if lag is not None:
            for listener in cfg.staleness:
                listener.observe_version_lag(lag)
        bound = cfg.max_version_lag
        if self._too_stale is None and (bound is None or lag is None or lag <= bound):
            return lag
        # Sticky: the version of a bound Session never changes, so a Session once too stale
        # stays too stale (a cached revision never moves back, but a later read may be missing).
        lag = max(lag or 0, self._too_stale or 0)
        first = self._too_stale is None
        if first:
            self._too_stale = lag
        for listener in cfg.staleness:
            listener.observe_version_too_stale(lag)
        if first:
            logger.warning(
                "session version too stale",
                extra={
                    "session": self._key,
                    "version": binding.version_id,
                    "lag": lag,
                    "max_version_lag": bound,
                },
            )
        raise VersionTooStaleError(
            f"session {self._key!r}: its version {binding.version_id!r} is {lag} publications "
            f"behind the default (max_version_lag {bound}); nothing was sent, the Session can "
            "only be closed",
            session=self._key,
            version=binding.version_id,
            lag=lag,
            max_version_lag=bound,
        )

    # --- close -----------------------------------------------------------------------------------

    async def _registry_call(self, stage: str, call: Callable[[], Awaitable[_T]]) -> _T:
        try:
            return await self._cfg.retry.call(stage, call)
        except Exception as exc:
            raise SessionReleaseError(
                f"session {self._key!r}: {stage} was not confirmed ({exc!r}); the Session "
                "stays FINALIZING and close() can be called again",
                session=self._key,
                stage=stage,
            ) from exc

    def _close_ids(self) -> tuple[str, str]:
        """The request ids of ``begin_close`` and ``release``, the same for every replay."""
        ids = self._close_request_ids
        if ids is None:
            ids = self._close_request_ids = (new_rid(), new_rid())
        return ids

    async def begin_close(self) -> None:
        registry = self._cfg.registry
        request_id = self._close_ids()[0]
        await self._registry_call(
            "begin_close",
            lambda: registry.begin_close(request_id=request_id, session_key=self._key),
        )

    async def settle_bind(self) -> None:
        bind_task = self._bind_task
        if bind_task is not None:
            # Never cancelled: it either bound before begin_close (release drops that ref) or is
            # refused with SESSION_CLOSED. Its error was already handed to its waiters.
            if not bind_task.done():  # the common case, a bind long done, costs no waiter
                await asyncio.wait([bind_task])
            self.bind_settled()

    def bind_settled(self) -> bool:
        bind_task = self._bind_task
        if bind_task is None:
            return True
        if not bind_task.done():
            return False
        if not bind_task.cancelled():
            bind_task.exception()  # handed to its waiters already; seen, so never logged as lost
        return True

    async def release(self) -> ReleaseResult:
        registry = self._cfg.registry
        request_id = self._close_ids()[1]
        return await self._registry_call(
            "release",
            lambda: registry.release(request_id=request_id, session_key=self._key),
        )
