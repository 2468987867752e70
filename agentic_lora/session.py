"""Sessions: bind once at the first generation, send exactly that version, release exactly once.

Users hold a :class:`Versioning` (one per rollout worker) and open a :class:`Session` per agent
episode::

    async with versioning.session(session_id) as s:
        out = await s.generate({"text": prompt, "sampling_params": {"max_new_tokens": 64}})

or, for frameworks without context managers, ``s = versioning.open_session(id)`` ... ``await
s.close()``.

A Session's life (one transition table, :data:`TRANSITIONS`)::

    OPEN --first generation binds--> BOUND --close--> FINALIZING --released--> CLOSED
      \\------------------------------close-----------^

* OPEN binds nothing. The first generation starts ONE bind task (registry ``bind_first``); every
  concurrent first generation awaits that task through :func:`asyncio.shield`, so cancelling a
  waiter never cancels the binding, and once bound no request reads the default again.
* If the bind task fails (no version published yet, a lost reply), the next generation replays
  ``bind_first`` with the same request id; the registry answers per Session, so a replay can
  only ever return the first answer, never a fresh choice.
* Close: FINALIZING (no new dispatch) -> ``begin_close`` (a late bind is now refused) -> wait for
  the bind task -> abort and drain in-flight requests -> ``release`` (retried with the same
  request id until confirmed; on failure :class:`~agentic_lora.errors.SessionReleaseError` and the
  Session stays FINALIZING so close can be called again) -> drop the record -> ``forget_sessions``.

With the feature flag off a Session is a pass-through: no registry, no binding, and every body
goes out exactly as the caller sent it (the legacy fixed adapter name included).

Engine kinds (``engine_kind``): SGLang is the default. On vLLM a versioned Session sends only the
OpenAI routes (``/generate`` is refused before binding, see
:func:`~agentic_lora.middleware.check_route`), names its adapter as ``model=<lora_name>``, and
cannot abort a request by id (vLLM has no such route): :meth:`Session.abort` raises, and close
waits for in-flight requests to end instead of aborting them.

Owner leases (``Versioning(lease=LeaseKeeper(...))``; built from settings when the flag is on, see
:mod:`agentic_lora.leases`): a Session binds under its worker's lease, so the ref is released by
the registry when the worker dies (TTL) or restarts (at once). A Session keeps the lease it first
tried to bind under for life: every replay of its bind carries that lease (with the same request
id), so the registry can only ever hold its ref under it. Every dispatch checks that lease first
(sync, no I/O): once it is lost the dispatch is refused with
:class:`~agentic_lora.errors.SessionExpiredError` (``SESSION_EXPIRED``) before the bind and before
any engine call, because the ref may already be released and the version reclaimed. Such a Session
can only be closed (``begin_close``/``release`` answer ``released_now=False``). Sessions that first
bind after the loss get the keeper's fresh incarnation and work. ``lease=None`` keeps Sessions
lease-free (their refs then live until closed).

Bounded staleness (``Versioning(max_version_lag=K)``, settings ``max_version_lag``; off by
default): a Session's version never changes, but once its bound version is more than K
publications behind the current default (the lag, see :mod:`agentic_lora.provenance`), its next
dispatch is refused with :class:`~agentic_lora.errors.VersionTooStaleError`
(``VERSION_TOO_STALE``, details ``lag`` and ``version``) after the bind and before any engine
call. The check runs only when a dispatch starts, so a generation already running is never cut.
The refusal is sticky (every later dispatch is refused too); the Session can only be closed,
which releases its ref so the retired version can be reclaimed and its capacity slot reused.
Every versioned reply carries :class:`~agentic_lora.provenance.TurnProvenance`
(``reply.provenance``) and :meth:`Session.provenance` returns the whole trajectory's record.

:meth:`Versioning.wait_drained` waits until no request of this manager's Sessions is in flight on
an adapter; the vLLM backend awaits it before unloading a reclaimed version, because vLLM's unload
does not wait for requests still running on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential
from tenacity.wait import wait_base

from agentic_lora.backends import EngineRef
from agentic_lora.errors import (
    AgenticLoRAError,
    ConfigurationError,
    InvalidRequestError,
    LeaseExpiredError,
    RequestRefusedError,
    SessionClosedError,
    SessionExpiredError,
    SessionReleaseError,
    SessionStateError,
    VersionTooStaleError,
)
from agentic_lora.leases import LeaseKeeper, LeaseTerm, OnRestart
from agentic_lora.middleware import (
    ENGINE_KINDS,
    AdapterInFlight,
    AdapterPinMiddleware,
    Dispatch,
    DispatchGuard,
    DispatchGuardMiddleware,
    EngineCall,
    EngineKind,
    InFlight,
    Middleware,
    PeekGuard,
    RefusedListener,
    RoutingMiddleware,
    TransportEndpoint,
    build_chain,
    check_route,
)
from agentic_lora.provenance import (
    CoreRevision,
    DefaultRevisionReader,
    StalenessListener,
    TurnProvenance,
    version_lag,
)
from agentic_lora.registry.api import RegistryAPI
from agentic_lora.registry.types import Binding, ReleaseResult, new_request_id
from agentic_lora.requests import RequestLike, Route, request_body
from agentic_lora.routing import EngineHealth, Router, load_router
from agentic_lora.transport import EngineReply, EngineTransport

if TYPE_CHECKING:
    from agentic_lora.config import AgenticLoRASettings

__all__ = ["TRANSITIONS", "Session", "SessionPhase", "Versioning", "next_phase"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


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


def _is_transient(exc: BaseException) -> bool:
    # A typed error is the registry's answer; anything else (a lost reply, a dead actor, a
    # timeout) may succeed when replayed with the same request id.
    return isinstance(exc, Exception) and not isinstance(exc, AgenticLoRAError)


@dataclass(frozen=True, slots=True)
class _Runtime:
    """What every Session of one Versioning shares."""

    versioned: bool
    engine_kind: EngineKind
    registry: RegistryAPI | None
    chain: Dispatch
    transport: EngineTransport
    registry_attempts: int
    registry_wait: wait_base
    on_closed: Callable[[Session], Awaitable[None]]
    lease: LeaseKeeper | None = None
    max_version_lag: int | None = None
    revision: DefaultRevisionReader | None = None
    staleness: Sequence[StalenessListener] = ()


class Session:
    """One agent Session (see module docstring). Create it with :meth:`Versioning.open_session`."""

    def __init__(self, session_id: str, session_key: str, runtime: _Runtime) -> None:
        self._id = session_id
        self._key = session_key
        self._rt = runtime
        self._phase = SessionPhase.OPEN
        self._binding: Binding | None = None
        self._bind_task: asyncio.Task[Binding] | None = None
        self._close_task: asyncio.Task[ReleaseResult | None] | None = None
        self._release_result: ReleaseResult | None = None
        # The lease of this Session's first bind attempt, kept for life (see module docstring).
        self._term: LeaseTerm | None = None
        # One idempotency key per registry verb for this lifecycle: every replay reuses it.
        self._bind_request_id = new_request_id()
        self._begin_close_request_id = new_request_id()
        self._release_request_id = new_request_id()
        self._in_flight: set[InFlight] = set()
        self._drained = asyncio.Event()
        self._drained.set()
        # The lag of every turn that returned a reply, in the order the replies came back.
        self._lags: list[int | None] = []
        # The lag of the first VERSION_TOO_STALE refusal; once set, every dispatch is refused.
        self._too_stale: int | None = None
        # The last turn's provenance, reused while the lag stays the same (the binding never
        # changes once set, so only the lag can differ between turns).
        self._turn: TurnProvenance | None = None

    # --- what it is ------------------------------------------------------------------------------

    @property
    def session_id(self) -> str:
        """The framework's id for this Session (reused ids are new lifecycles)."""
        return self._id

    @property
    def key(self) -> str:
        """The registry key: session id plus a nonce unique to this lifecycle."""
        return self._key

    @property
    def phase(self) -> SessionPhase:
        """The current phase."""
        return self._phase

    @property
    def binding(self) -> Binding | None:
        """The version this Session is bound to (None before its first generation)."""
        return self._binding

    @property
    def in_flight(self) -> int:
        """Requests of this Session currently dispatched and not yet ended."""
        return len(self._in_flight)

    @property
    def lease(self) -> LeaseTerm | None:
        """The owner lease this Session binds under (None before its first bind, or lease-free)."""
        return self._term

    @property
    def release_result(self) -> ReleaseResult | None:
        """The registry's answer to the release, once the Session is CLOSED (versioned only)."""
        return self._release_result

    def __repr__(self) -> str:
        version = self._binding.version_id if self._binding else None
        return f"Session({self._key!r}, {self._phase.value}, version={version!r})"

    def _advance(self, target: SessionPhase) -> None:
        self._phase = next_phase(self._phase, target, session=self._key)

    def _require_dispatchable(self) -> None:
        if self._phase in (SessionPhase.FINALIZING, SessionPhase.CLOSED):
            raise SessionClosedError(
                f"session {self._key!r} is {self._phase.value}; no new dispatch",
                session=self._key,
                phase=self._phase.value,
            )

    # --- binding ---------------------------------------------------------------------------------

    async def _lease_for_bind(self) -> LeaseTerm | None:
        keeper = self._rt.lease
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
        registry = self._rt.registry
        assert registry is not None
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
        if self._phase is SessionPhase.OPEN:
            self._advance(SessionPhase.BOUND)
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
        return await asyncio.shield(task)

    # --- dispatch --------------------------------------------------------------------------------

    async def generate(self, request: RequestLike) -> EngineReply:
        """SGLang ``/generate`` with this Session's version (binds on the first call)."""
        return await self.dispatch(Route.GENERATE, request)

    async def chat_completions(self, request: RequestLike) -> EngineReply:
        """OpenAI ``/v1/chat/completions`` with this Session's version."""
        return await self.dispatch(Route.CHAT_COMPLETIONS, request)

    async def completions(self, request: RequestLike) -> EngineReply:
        """OpenAI ``/v1/completions`` with this Session's version."""
        return await self.dispatch(Route.COMPLETIONS, request)

    async def dispatch(self, route: Route, request: RequestLike) -> EngineReply:
        """Send one request down the chain: exactly one attempt, failures classified.

        A tool turn, a retry after an error and a resume after :meth:`abort` are all just another
        dispatch: they carry the same bound version and never read the default again.
        """
        self._require_dispatchable()
        versioned = self._rt.versioned
        body = request_body(route, request, validate=versioned)
        binding: Binding | None = None
        if versioned:
            # Before the bind: a request the engine cannot serve must not bind the Session.
            check_route(route, self._rt.engine_kind)
            if body.get("stream"):
                raise InvalidRequestError(
                    "streaming is not supported on a versioned Session; send stream=false",
                    route=route.value,
                )
            term = self._term
            if term is not None:
                # Before the bind and any engine call: a Session whose lease is lost sends
                # nothing (its ref may be released and its version reclaimed already).
                term.check(session=self._key)
            binding = await self._bound()
            # Close may have started while this request waited for the bind.
            self._require_dispatchable()
            term = self._term
            if term is not None:
                # The bind, or the wait for it, may have outlasted the lease.
                term.check(session=self._key)
                term.touch()
            # Only here, at the start of a dispatch: a generation already running is never cut
            # by a publication that lands while it runs (its reply still comes back).
            lag = self._check_lag(binding)
            if body.get("rid") is None:
                body["rid"] = uuid.uuid4().hex
        rid = body.get("rid")
        flight = InFlight(rid=rid if isinstance(rid, str) else None)
        self._in_flight.add(flight)
        self._drained.clear()
        try:
            reply = await self._rt.chain(
                EngineCall(
                    route=route, body=body, session_key=self._key, binding=binding, ticket=flight
                )
            )
        finally:
            self._in_flight.discard(flight)
            if not self._in_flight:
                self._drained.set()
        if binding is None:
            return reply
        turn = self._turn
        if turn is None or turn.lag != lag:
            turn = self._turn = TurnProvenance.of(binding, lag)
        self._lags.append(lag)
        return reply.with_provenance(turn)

    def _check_lag(self, binding: Binding) -> int | None:
        rt = self._rt
        reader = rt.revision
        lag = version_lag(binding, reader.default_revision() if reader is not None else None)
        if lag is not None:
            for listener in rt.staleness:
                listener.observe_version_lag(lag)
        bound = rt.max_version_lag
        if self._too_stale is None and (bound is None or lag is None or lag <= bound):
            return lag
        # Sticky: the version of a bound Session never changes, so a Session once too stale
        # stays too stale (a cached revision never moves back, but a later read may be missing).
        lag = max(lag or 0, self._too_stale or 0)
        first = self._too_stale is None
        if first:
            self._too_stale = lag
        for listener in rt.staleness:
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

    def provenance(self) -> dict[str, Any]:
        """This Session's trajectory provenance, JSON-able, for the trainer to store with it.

        ``version_id``, ``digest`` (full), ``lora_name`` and ``default_revision_at_bind`` are
        None before the first bind (and on a pass-through Session). ``lags`` holds the lag of
        every turn that returned a reply, in reply order (None where the registry client could
        not say the current revision); ``turns`` is their count. ``too_stale_lag`` is the lag
        of the ``VERSION_TOO_STALE`` refusal that ended the Session's dispatching, else None.
        """
        b = self._binding
        return {
            "session_id": self._id,
            "version_id": b.version_id if b is not None else None,
            "digest": b.digest if b is not None else None,
            "lora_name": b.lora_name if b is not None else None,
            "default_revision_at_bind": b.default_revision if b is not None else None,
            "lags": list(self._lags),
            "turns": len(self._lags),
            "too_stale_lag": self._too_stale,
        }

    async def abort(self, rid: str) -> bool:
        """Abort this Session's in-flight request ``rid`` on its engine; the binding stays.

        Returns False when no such request is in flight here (already ended, or not yet routed).
        The aborted request ends with ``finish_reason.type == "abort"``; resume by dispatching
        again, which carries the same ``lora_path``. On vLLM engines, which cannot abort a request
        by id, this raises InvalidRequestError.
        """
        if self._rt.engine_kind == "vllm":
            raise InvalidRequestError(
                "vLLM engines have no route to abort a request by id; nothing was sent",
                session=self._key,
                rid=rid,
                engine_kind=self._rt.engine_kind,
                reason="abort_unsupported",
            )
        for flight in list(self._in_flight):
            if flight.rid == rid and flight.engine is not None:
                await self._rt.transport.abort(flight.engine, rid)
                return True
        return False

    # --- close -----------------------------------------------------------------------------------

    async def close(self) -> ReleaseResult | None:
        """Finish this Session: refuse new dispatch, drain, release exactly once (see module doc).

        Idempotent: a closed Session returns its first result without calling the registry, and
        concurrent closes share one finalization. Raises SessionReleaseError if the release is not
        confirmed; the Session then stays FINALIZING and ``close()`` may be called again.
        """
        if self._phase is SessionPhase.CLOSED:
            return self._release_result
        task = self._close_task
        if task is None or task.done():
            if self._phase in (SessionPhase.OPEN, SessionPhase.BOUND):
                self._advance(SessionPhase.FINALIZING)
            task = asyncio.get_running_loop().create_task(
                self._finalize(), name=f"close {self._key}"
            )
            self._close_task = task
        return await asyncio.shield(task)

    async def _registry_call(self, stage: str, call: Callable[[], Awaitable[_T]]) -> _T:
        try:
            async for attempt in AsyncRetrying(
                stop=stop_after_attempt(self._rt.registry_attempts),
                wait=self._rt.registry_wait,
                retry=retry_if_exception(_is_transient),
                reraise=True,
            ):
                with attempt:
                    n = attempt.retry_state.attempt_number
                    if n > 1:
                        logger.warning(
                            "replaying registry call",
                            extra={"session": self._key, "stage": stage, "attempt": n},
                        )
                    return await call()
        except Exception as exc:
            raise SessionReleaseError(
                f"session {self._key!r}: {stage} was not confirmed ({exc!r}); the Session "
                "stays FINALIZING and close() can be called again",
                session=self._key,
                stage=stage,
            ) from exc
        raise AssertionError("unreachable: tenacity either returns or raises")  # pragma: no cover

    async def _finalize(self) -> ReleaseResult | None:
        registry = self._rt.registry if self._rt.versioned else None
        if registry is not None:
            await self._registry_call(
                "begin_close",
                lambda: registry.begin_close(
                    request_id=self._begin_close_request_id, session_key=self._key
                ),
            )
        bind_task = self._bind_task
        if bind_task is not None:
            # Never cancelled: it either bound before begin_close (release drops that ref) or
            # is refused with SESSION_CLOSED. Its error was already handed to its waiters.
            await asyncio.wait([bind_task])
            if not bind_task.cancelled():
                bind_task.exception()
        await self._abort_in_flight()
        if self._in_flight:
            logger.info(
                "close waits for in-flight requests to end",
                extra={"session": self._key, "in_flight": len(self._in_flight)},
            )
        await self._drained.wait()
        result: ReleaseResult | None = None
        if registry is not None:
            result = await self._registry_call(
                "release",
                lambda: registry.release(
                    request_id=self._release_request_id, session_key=self._key
                ),
            )
        self._release_result = result
        self._advance(SessionPhase.CLOSED)
        logger.info(
            "session closed",
            extra={
                "session": self._key,
                "version": result.version_id if result is not None else None,
                "released_now": result.released_now if result is not None else None,
            },
        )
        await self._rt.on_closed(self)
        return result

    async def _abort_in_flight(self) -> None:
        if self._rt.engine_kind == "vllm":
            return  # no abort route: the drain that follows waits for them to end
        targets = [(f.engine, f.rid) for f in self._in_flight if f.engine and f.rid]
        for engine, rid in targets:
            try:
                await self._rt.transport.abort(engine, rid)
            except AgenticLoRAError as exc:
                # The request still ends (answer or client timeout); draining waits for it.
                logger.warning(
                    "abort on close failed",
                    extra={"session": self._key, "engine": engine, "rid": rid, "error": str(exc)},
                )


def _revision_reader_of(registry: RegistryAPI) -> DefaultRevisionReader | None:
    if isinstance(registry, DefaultRevisionReader):
        return registry
    from agentic_lora.registry.local import LocalRegistry

    if isinstance(registry, LocalRegistry):
        # In process: the core's revision is exact, never a stale copy.
        return CoreRevision(registry.core)
    return None


class Versioning:
    """The manager a rollout worker holds: opens Sessions and owns the dispatch chain.

    ``enabled=False`` (the framework flag off) makes every Session a pass-through that sends the
    caller's body untouched; then ``registry`` is not used. ``engine_kind`` (``"sglang"`` or
    ``"vllm"``) decides how a request names its adapter (see
    :func:`~agentic_lora.middleware.pin_adapter`).

    ``lease`` is the worker's :class:`~agentic_lora.leases.LeaseKeeper` (one per Versioning):
    Sessions bind under it, and :meth:`aclose` closes it after the Sessions. None (the default for
    direct construction; :meth:`from_settings` makes one) keeps Sessions lease-free.

    ``max_version_lag`` (None: off) bounds staleness per Session: a dispatch whose bound version
    is more than that many publications behind the current default is refused with
    :class:`~agentic_lora.errors.VersionTooStaleError` (see :meth:`Session.provenance`).
    ``revision_reader`` says the current default revision without I/O; by default the registry
    itself if it is a :class:`~agentic_lora.provenance.DefaultRevisionReader` (the Ray client),
    or the core of a ``LocalRegistry``. Without one, lags are unknown (None) and a bound is a
    configuration error.
    """

    def __init__(
        self,
        *,
        transport: EngineTransport,
        registry: RegistryAPI | None = None,
        enabled: bool = True,
        router: Router | None = None,
        guard: DispatchGuard | None = None,
        base_model: str | None = None,
        engine_kind: EngineKind = "sglang",
        deployment_epoch: int = 0,
        middleware: Sequence[Middleware] = (),
        registry_attempts: int = 4,
        registry_wait: wait_base | None = None,
        owns_transport: bool = False,
        owns_registry: bool = False,
        lease: LeaseKeeper | None = None,
        max_version_lag: int | None = None,
        revision_reader: DefaultRevisionReader | None = None,
    ) -> None:
        if registry_attempts < 1:
            raise ConfigurationError(
                "registry_attempts must be at least 1", check="registry_attempts"
            )
        if engine_kind not in ENGINE_KINDS:
            raise ConfigurationError(
                f"engine kind {engine_kind!r} is not one of {list(ENGINE_KINDS)}",
                check="engine_kind",
            )
        self._enabled = enabled
        self._engine_kind: EngineKind = engine_kind
        self._adapter_requests = AdapterInFlight()
        self._registry = registry
        self._transport = transport
        self._owns_transport = owns_transport
        self._owns_registry = owns_registry
        self._epoch = deployment_epoch
        if lease is not None and not enabled:
            raise ConfigurationError(
                "a lease keeper needs versioned publication (pass-through Sessions bind nothing)",
                check="lease",
            )
        self._lease = lease
        if revision_reader is None and enabled and registry is not None:
            revision_reader = _revision_reader_of(registry)
        if max_version_lag is not None:
            if isinstance(max_version_lag, bool) or not isinstance(max_version_lag, int):
                raise ConfigurationError(
                    f"max_version_lag {max_version_lag!r} is not an integer",
                    check="max_version_lag",
                )
            if max_version_lag < 0:
                raise ConfigurationError(
                    f"max_version_lag {max_version_lag} must be 0 or more",
                    check="max_version_lag",
                )
            if not enabled or revision_reader is None:
                raise ConfigurationError(
                    "max_version_lag needs versioned publication and a registry whose current "
                    "default revision can be read without I/O (pass revision_reader)",
                    check="max_version_lag",
                )
        self._max_version_lag = max_version_lag
        #: Told the lag of every versioned dispatch and every VERSION_TOO_STALE refusal (the
        #: metrics hook, see :meth:`agentic_lora.metrics.Metrics.watch_staleness`); append any time.
        self.staleness_listeners: list[StalenessListener] = []
        engines = [e.name for e in transport.engines]
        self._health = EngineHealth(engines)
        self._router = router if router is not None else load_router("session-affinity")
        chain: list[Middleware] = list(middleware)
        if enabled:
            if registry is None:
                raise ConfigurationError(
                    "versioned publication is enabled but no registry was given", check="registry"
                )
            if guard is None:
                peek = getattr(registry, "peek_version", None)
                if not callable(peek):
                    raise ConfigurationError(
                        f"{type(registry).__name__} has no peek_version; pass a DispatchGuard",
                        check="dispatch_guard",
                    )
                guard = PeekGuard(peek)
            chain += [
                Middleware(AdapterPinMiddleware, base_model=base_model, engine_kind=engine_kind),
                Middleware(DispatchGuardMiddleware, guard=guard, in_flight=self._adapter_requests),
            ]
        #: Told ``(engine, binding)`` when an engine refused a versioned request (see
        #: :class:`~agentic_lora.middleware.RoutingMiddleware`); append listeners at any time.
        self.on_refused: list[RefusedListener] = []
        chain.append(
            Middleware(
                RoutingMiddleware,
                router=self._router,
                health=self._health,
                on_refused=self.on_refused,
            )
        )
        self._runtime = _Runtime(
            versioned=enabled,
            engine_kind=engine_kind,
            registry=registry,
            chain=build_chain(TransportEndpoint(transport), chain),
            transport=transport,
            registry_attempts=registry_attempts,
            registry_wait=(
                registry_wait
                if registry_wait is not None
                else wait_exponential(multiplier=0.05, max=2.0)
            ),
            on_closed=self._on_closed,
            lease=lease,
            max_version_lag=max_version_lag,
            revision=revision_reader,
            staleness=self.staleness_listeners,
        )
        self._live: dict[str, Session] = {}
        self._keys: set[str] = set()  # registry keys of live Sessions (explicit keys stay unique)
        self._unforgotten: list[str] = []

    @classmethod
    def from_settings(
        cls,
        settings: AgenticLoRASettings,
        *,
        registry: RegistryAPI | None = None,
        transport: EngineTransport | None = None,
        middleware: Sequence[Middleware] = (),
        lease_owner: str | None = None,
        lease_on_restart: OnRestart = "release",
    ) -> Versioning:
        """Build from validated settings. Without ``registry`` (flag on) a LocalRegistry is made.

        With the flag on, Sessions bind under a :class:`~agentic_lora.leases.LeaseKeeper` built
        from the settings (``owner_id``, ``lease_ttl``, ``lease_renew_interval``); ``lease_owner``
        overrides the owner and ``lease_on_restart`` says what a restart does with the
        predecessor's Sessions (``"release"`` for rollout workers, ``"adopt"`` for a gateway).
        """
        owns_transport = transport is None
        owns_registry = False
        if transport is None:
            transport = EngineTransport(
                settings.engines,
                request_timeout=settings.request_timeout,
                connect_timeout=settings.connect_timeout,
                http_transport=settings.http_transport,
            )
        if settings.enable_versioned_lora_publication and registry is None:
            from agentic_lora.registry.local import LocalRegistry

            registry = LocalRegistry(
                engines=[e.name for e in settings.engines],
                capacity=settings.capacity,
                deployment_epoch=settings.deployment_epoch,
                prefix=settings.lora_name_prefix,
                journal_path=settings.journal_path,
                name_ttl=settings.session_name_ttl,
            )
            owns_registry = True
        lease: LeaseKeeper | None = None
        if settings.enable_versioned_lora_publication:
            assert registry is not None
            lease = LeaseKeeper.from_settings(
                settings, registry, owner=lease_owner, on_restart=lease_on_restart
            )
        return cls(
            transport=transport,
            registry=registry,
            enabled=settings.enable_versioned_lora_publication,
            router=load_router(settings.router),
            base_model=settings.base_model_name,
            engine_kind=settings.engine_kind,
            deployment_epoch=settings.deployment_epoch,
            middleware=middleware,
            owns_transport=owns_transport,
            owns_registry=owns_registry,
            lease=lease,
            max_version_lag=(
                settings.max_version_lag if settings.enable_versioned_lora_publication else None
            ),
        )

    @property
    def enabled(self) -> bool:
        """Whether versioned publication is on (off: pass-through Sessions)."""
        return self._enabled

    @property
    def engine_kind(self) -> EngineKind:
        """How requests address an adapter (``"sglang"`` or ``"vllm"``)."""
        return self._engine_kind

    @property
    def registry(self) -> RegistryAPI | None:
        """The registry Sessions bind through (None in pass-through mode)."""
        return self._registry

    @property
    def lease(self) -> LeaseKeeper | None:
        """The owner lease Sessions bind under (None: lease-free Sessions)."""
        return self._lease

    @property
    def max_version_lag(self) -> int | None:
        """The staleness bound of this manager's Sessions (None: off)."""
        return self._max_version_lag

    def in_flight(self, lora_name: str) -> int:
        """Requests of this manager's Sessions in flight on adapter ``lora_name``."""
        return self._adapter_requests.count(lora_name)

    async def wait_drained(self, lora_name: str) -> None:
        """Return once no request of this manager's Sessions is in flight on ``lora_name``.

        The drain hook of backends whose engine does not wait for in-flight requests on unload
        (``VllmBackend(wait_drained=versioning.wait_drained)``). Event-driven: it returns at the
        first moment the adapter's count reaches zero (at once if it is zero). It sees only this
        process's Sessions; a reclaim awaits it after the version left the dispatchable states,
        so no new request can start on it meanwhile.
        """
        await self._adapter_requests.wait_drained(lora_name)

    @property
    def engines(self) -> tuple[EngineRef, ...]:
        """The fixed engine fleet."""
        return self._transport.engines

    @property
    def transport(self) -> EngineTransport:
        """The engine transport (e.g. for :func:`agentic_lora.config.verify_fleet` at start-up)."""
        return self._transport

    @property
    def router(self) -> Router:
        """The router plugin in the chain."""
        return self._router

    @property
    def health(self) -> EngineHealth:
        """Engine health: mark an engine unhealthy to stop routing new dispatches to it."""
        return self._health

    def live_sessions(self) -> tuple[Session, ...]:
        """Sessions not yet closed (including ones whose release failed)."""
        return tuple(self._live.values())

    def get(self, session_id: str) -> Session | None:
        """The live Session with this id, if any."""
        return self._live.get(session_id)

    def open_session(self, session_id: str, *, session_key: str | None = None) -> Session:
        """Open a Session (OPEN, bound to nothing; no I/O). One live lifecycle per id.

        ``session_key`` continues an *existing* registry Session (for instance one the gateway
        found behind a durable name with ``open_named``, after a restart): the first dispatch
        calls ``bind_first`` for that key, which answers the binding the registry already holds,
        never a new choice (a key the registry does not know is simply a new Session). A name is
        opened under this manager's lease: ``(await versioning.lease.acquire()).lease_id``.
        Without ``session_key`` a fresh key is minted for a new lifecycle.
        """
        if not isinstance(session_id, str) or not session_id:
            raise InvalidRequestError(
                "a session id is a non-empty string", session=repr(session_id)
            )
        if session_key is not None and (
            not isinstance(session_key, str)
            or not session_key
            or not session_key.isprintable()
            or any(c.isspace() for c in session_key)
        ):
            raise InvalidRequestError(
                "a session key is a non-empty printable string without whitespace",
                session=repr(session_key),
            )
        if session_key is not None and session_key in self._keys:
            # Two live Session objects on one key would release its one ref twice over.
            raise SessionStateError(
                f"session key {session_key!r} is already open here; close it first",
                session=session_key,
            )
        existing = self._live.get(session_id)
        if existing is not None:
            raise SessionStateError(
                f"session {session_id!r} is still {existing.phase.value}; close it before reusing "
                "the id",
                session=existing.key,
                phase=existing.phase.value,
            )
        key = (
            session_key
            if session_key is not None
            else f"{session_id}#{self._epoch}-{uuid.uuid4().hex}"
        )
        s = Session(session_id, key, self._runtime)
        self._live[session_id] = s
        self._keys.add(key)
        return s

    @contextlib.asynccontextmanager
    async def session(self, session_id: str) -> AsyncIterator[Session]:
        """``async with versioning.session(id) as s``: open, then close however the block ends."""
        s = self.open_session(session_id)
        try:
            yield s
        finally:
            await s.close()

    async def close_session(self, session_id: str) -> ReleaseResult | None:
        """Close the live Session with this id (a no-op returning None if there is none)."""
        s = self._live.get(session_id)
        return None if s is None else await s.close()

    async def _on_closed(self, s: Session) -> None:
        if self._live.get(s.session_id) is s:
            del self._live[s.session_id]
        self._keys.discard(s.key)
        if self._registry is None or not self._enabled:
            return
        # Tombstones go only after the record is gone, so nothing can bind this key again.
        self._unforgotten.append(s.key)
        keys = list(self._unforgotten)
        try:
            await self._registry.forget_sessions(request_id=new_request_id(), session_keys=keys)
        except Exception as exc:
            # Not a correctness problem (a tombstone only costs memory): retried with the next.
            logger.warning(
                "forget_sessions failed; will retry with the next close",
                extra={"session": s.key, "pending": len(keys), "error": repr(exc)},
            )
            return
        del self._unforgotten[: len(keys)]

    async def aclose(self) -> None:
        """Close every live Session, then the owner lease (``close_lease``: a clean shutdown
        leaves nothing to expire later) and stop renewing it, then the transport and registry if
        this manager made them.

        If a Session's release is not confirmed, raises its SessionReleaseError *before* closing
        anything, on purpose: the lease, registry and transport stay open so ``aclose()`` can be
        called again and the release retried (closing them would strand the Session's ref for good).
        """
        errors: list[SessionReleaseError] = []
        for s in list(self._live.values()):
            try:
                await s.close()
            except SessionReleaseError as exc:
                errors.append(exc)
        if errors:
            raise errors[0]
        if self._lease is not None:
            await self._lease.aclose()
        if self._owns_transport:
            await self._transport.aclose()
        closer = getattr(self._registry, "aclose", None) if self._owns_registry else None
        if closer is not None:
            await closer()
