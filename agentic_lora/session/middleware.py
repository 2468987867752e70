"""The dispatch chain: small middlewares, each wrapping the next, ending at the engine transport.

A :data:`Dispatch` takes an :class:`EngineCall` and returns an
:class:`~agentic_lora.engines.transport.EngineReply`. A middleware is a class built as
``Middleware(next_dispatch, **options)`` whose instances are themselves a ``Dispatch`` (the shape
of a Starlette middleware). :func:`build_chain` stacks them; the first one listed runs first.

For a versioned Session the chain is::

    framework middleware ... -> AdapterPinMiddleware -> DispatchGuardMiddleware
        -> RoutingMiddleware -> TransportEndpoint

* :class:`AdapterPinMiddleware` writes the Session's bound ``lora_name`` into the body the way
  the engine dialect addresses an adapter (:meth:`~agentic_lora.engines.dialect.EngineDialect.pin`),
  and refuses a caller that named another adapter. SGLang: ``lora_path`` for ``/generate``,
  ``model="<base>:<lora_name>"`` for OpenAI routes; vLLM: ``model=<lora_name>``. A route the
  engine does not serve was refused by the Session before it bound (the one route check per
  request).
* :class:`DispatchGuardMiddleware` refuses, locally, a version that is reclaiming or gone: an
  engine would otherwise reload it from its old path and resurrect it behind the registry's back.
  It also hands on which engines hold the version right now (``EngineCall.engines``: an engine
  that restarted holds nothing until the repairer loaded the version onto it again), and counts
  every request it lets through per adapter (:class:`AdapterInFlight`), so a reclaim on an engine
  whose unload does not wait for in-flight requests (vLLM) can wait for them.
* :class:`RoutingMiddleware` lets the router pick one of the healthy engines that hold the
  version (it sees a read-only body); none: :class:`~agentic_lora.errors.VersionUnavailableError`
  before anything is sent. An engine's refusal of a versioned request is reported to the
  ``on_refused`` listeners (the repairer probes at once instead of at its next tick).
* :class:`TransportEndpoint` sends once.

Framework middlewares run before the pin, so whatever they put in the body is checked against the
binding, never trusted.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field
from types import MappingProxyType
from typing import Any
from typing import Protocol
from typing import runtime_checkable

from agentic_lora.engines.dialect import EngineDialect
from agentic_lora.engines.routing import EngineHealth
from agentic_lora.engines.routing import Router
from agentic_lora.engines.sglang import SGLANG
from agentic_lora.engines.transport import EngineReply
from agentic_lora.engines.transport import EngineTransport
from agentic_lora.errors import ConfigurationError
from agentic_lora.errors import RequestRefusedError
from agentic_lora.errors import SessionStateError
from agentic_lora.errors import VersionNotDispatchableError
from agentic_lora.errors import VersionUnavailableError
from agentic_lora.foundation.requests import Route
from agentic_lora.registry.api import in_process_core
from agentic_lora.registry.api import peeker
from agentic_lora.registry.types import Binding
from agentic_lora.registry.types import DispatchView
from agentic_lora.registry.types import VersionStatus
from agentic_lora.session.in_flight import AdapterInFlight
from agentic_lora.session.in_flight import DrainWaitListener
from agentic_lora.session.in_flight import InFlight

__all__ = [
    "AdapterInFlight",
    "AdapterPinMiddleware",
    "Dispatch",
    "DispatchGuard",
    "DispatchGuardMiddleware",
    "DrainWaitListener",
    "EngineCall",
    "InFlight",
    "Middleware",
    "PeekGuard",
    "RefusedListener",
    "RoutingMiddleware",
    "TransportEndpoint",
    "build_chain",
    "pin_adapter",
]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineCall:
    """One request travelling down the chain. Never changed in place: a middleware hands the next
    one a changed copy (:meth:`with_body`, :meth:`with_engines`, :meth:`routed_to`, or
    :func:`dataclasses.replace`), so a middleware that kept the call it was given still reads
    what it was given.

    ``engines``: the engines that hold the bound version right now (set by the dispatch guard;
    None: no restriction, e.g. a pass-through Session). ``engine``: the one the router chose.
    """

    route: Route
    body: Mapping[str, Any]
    session_key: str | None = None
    binding: Binding | None = None
    engine: str | None = None
    ticket: InFlight | None = field(default=None, compare=False)
    engines: tuple[str, ...] | None = None

    # The hot path's copies call the constructor directly: dataclasses.replace costs about
    # twice as much per dispatch (it walks the fields by name). Not frozen: a frozen dataclass
    # sets each field through object.__setattr__, three times the cost of the four copies a
    # versioned dispatch makes; immutability is the rule above, which every middleware keeps.

    def with_body(self, body: Mapping[str, Any]) -> EngineCall:
        """This call with another body."""
        return EngineCall(
            self.route, body, self.session_key, self.binding, self.engine, self.ticket, self.engines
        )

    def with_engines(self, engines: tuple[str, ...] | None) -> EngineCall:
        """This call restricted to ``engines`` (the holders of its version)."""
        return EngineCall(
            self.route, self.body, self.session_key, self.binding, self.engine, self.ticket, engines
        )

    def routed_to(self, engine: str) -> EngineCall:
        """This call with its engine chosen."""
        return EngineCall(
            self.route, self.body, self.session_key, self.binding, engine, self.ticket, self.engines
        )


Dispatch = Callable[[EngineCall], Awaitable[EngineReply]]

RefusedListener = Callable[[str, Binding], object]
"""``listener(engine, binding)``: ``engine`` refused a request of a Session bound to ``binding``.

Called synchronously on the dispatch path, so it must only note or schedule (poke a repairer,
start a refresh); an exception it raises is logged and never reaches the caller.
"""


class Middleware:
    """A middleware class plus its options, built later around the next dispatch."""

    def __init__(self, cls: Callable[..., Dispatch], /, **options: Any) -> None:
        self.cls = cls
        self.options = options

    def build(self, next_dispatch: Dispatch) -> Dispatch:
        """Instantiate the middleware around ``next_dispatch``."""
        return self.cls(next_dispatch, **self.options)

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        return (
            f"Middleware({getattr(self.cls, '__name__', self.cls)!r}{', ' if opts else ''}{opts})"
        )


def build_chain(endpoint: Dispatch, middleware: Sequence[Middleware]) -> Dispatch:
    """Wrap ``endpoint`` so that ``middleware[0]`` runs first."""
    dispatch = endpoint
    for m in reversed(middleware):
        dispatch = m.build(dispatch)
    return dispatch


# --- adapter pinning ----------------------------------------------------------------------------


def pin_adapter(
    route: Route,
    body: Mapping[str, Any],
    lora_name: str,
    base_model: str | None,
    *,
    dialect: EngineDialect = SGLANG,
) -> dict[str, Any]:
    """``body`` with the bound adapter written in the ``dialect``'s way; a different adapter
    named by the caller raises AdapterMismatchError (see
    :meth:`~agentic_lora.engines.dialect.EngineDialect.pin`)."""
    return dialect.pin(route, body, lora_name, base_model)


class AdapterPinMiddleware:
    """Writes the Session's bound adapter into every request (see :func:`pin_adapter`)."""

    def __init__(
        self,
        next_dispatch: Dispatch,
        *,
        base_model: str | None,
        dialect: EngineDialect = SGLANG,
    ) -> None:
        self._next = next_dispatch
        self._base_model = base_model
        self._pin = dialect.pin

    # Not a coroutine function: it hands back the next step's awaitable, one frame fewer per
    # dispatch (nothing of its own runs after the next step, so nothing needs awaiting here).
    # A refusal is raised when the call is made, which is also when the chain awaits it.
    def __call__(self, call: EngineCall) -> Awaitable[EngineReply]:
        binding = call.binding
        if binding is None:
            # Fail closed: a versioned request without a binding would run on the base model.
            raise SessionStateError(
                "a versioned dispatch reached the adapter pin without a binding",
                session=call.session_key,
            )
        body = self._pin(call.route, call.body, binding.lora_name, self._base_model)
        return self._next(call.with_body(body))


# --- dispatch guard -----------------------------------------------------------------------------


@runtime_checkable
class DispatchGuard(Protocol):
    """Says, without I/O, whether requests for a bound version may still reach an engine."""

    def check(self, binding: Binding) -> tuple[str, ...] | None:
        """Raise VersionNotDispatchableError unless dispatchable; else return the engines that
        hold the version now (the only ones it may be routed to), or None for "any engine"."""
        ...


class PeekGuard:
    """A DispatchGuard over a synchronous version read, e.g. ``LocalRegistry.peek_version`` (or
    ``RegistryCore.dispatch_view``, the same fields without the rest of the status)."""

    def __init__(self, peek: Callable[[str], VersionStatus | DispatchView | None]) -> None:
        self._peek = peek

    @classmethod
    def of(cls, registry: object) -> PeekGuard | None:
        """The guard over ``registry``'s cheapest synchronous read: the core's
        ``dispatch_view`` in process (no whole status per dispatch), else ``peek_version``; None
        when it has neither."""
        core = in_process_core(registry)
        if core is not None:
            return cls(core.dispatch_view)
        peek = peeker(registry)
        return None if peek is None else cls(peek.peek_version)

    def check(self, binding: Binding) -> tuple[str, ...]:
        """Raise unless the bound version is PUBLISHED or RETIRED (and is the same content);
        return its ``ready_engines``: the engines holding it under their current incarnation."""
        status = self._peek(binding.version_id)
        if status is None:
            raise VersionNotDispatchableError(
                f"version {binding.version_id!r} is unknown to the registry",
                version=binding.version_id,
                state=None,
            )
        if not status.state.dispatchable:
            raise VersionNotDispatchableError(
                f"version {binding.version_id!r} is {status.state.value}; "
                "it can no longer be dispatched",
                version=binding.version_id,
                state=status.state.value,
            )
        if status.lora_name != binding.lora_name:
            raise VersionNotDispatchableError(
                f"version {binding.version_id!r} is now {status.lora_name!r}, "
                f"not the bound {binding.lora_name!r}",
                version=binding.version_id,
                state=status.state.value,
            )
        return status.ready_engines


class DispatchGuardMiddleware:
    """Refuses, before any engine sees it, a request for a version that is reclaiming or gone.

    A request it lets through carries the guard's answer as ``EngineCall.engines`` (the engines
    holding the version), for :class:`RoutingMiddleware`. With ``in_flight``, every request it
    lets through is counted on its adapter until it ends.
    """

    def __init__(
        self,
        next_dispatch: Dispatch,
        *,
        guard: DispatchGuard,
        in_flight: AdapterInFlight | None = None,
    ) -> None:
        self._next = next_dispatch
        self._guard = guard
        self._in_flight = in_flight

    async def __call__(self, call: EngineCall) -> EngineReply:
        binding = call.binding
        if binding is None:
            return await self._next(call)
        holders = self._guard.check(binding)
        if holders is not None:
            call = call.with_engines(holders)
        if self._in_flight is None:
            return await self._next(call)
        # No await between the check and the count: a reclaim claimed after the check finds this
        # request counted and waits for it; one claimed before it is refused by the check.
        in_flight = self._in_flight
        lora_name = binding.lora_name
        in_flight.enter(lora_name)
        try:
            return await self._next(call)
        finally:
            in_flight.leave(lora_name)


# --- routing and the endpoint -------------------------------------------------------------------


class RoutingMiddleware:
    """Lets the router pick a healthy engine that holds the call's version; counts the dispatch
    in flight around the send.

    The router is offered the healthy engines in fleet order, narrowed to ``call.engines`` when
    the dispatch guard set it. A Session whose affinity engine lost its version (the engine
    restarted) therefore goes to another holder meanwhile and returns once the version is loaded
    there again; its prefix cache was on the lost engine process anyway. No holder among the
    healthy engines: :class:`~agentic_lora.errors.VersionUnavailableError`, nothing sent.

    ``on_refused``: listeners told ``(engine, binding)`` when an engine refused a versioned
    request (a 4xx, or unreachable): the cheapest restart detector there is, since a restarted
    SGLang engine answers 400 for an adapter it does not hold. The sequence is read at each
    refusal, so listeners added later (to the same list) are seen.
    """

    def __init__(
        self,
        next_dispatch: Dispatch,
        *,
        router: Router,
        health: EngineHealth,
        on_refused: Sequence[RefusedListener] = (),
    ) -> None:
        self._next = next_dispatch
        self._router = router
        self._health = health
        self._on_refused = on_refused

    async def __call__(self, call: EngineCall) -> EngineReply:
        engines = self._health.healthy()
        if not engines:
            raise RequestRefusedError(
                "no healthy engine to dispatch to; nothing was sent", session=call.session_key
            )
        holders = call.engines
        # Both are in fleet order, so the common case (every healthy engine holds the version)
        # is one tuple comparison and no allocation.
        if holders is not None and holders != engines:
            healthy = engines
            engines = tuple(e for e in healthy if e in holders)
            if not engines:
                raise self._unavailable(call, healthy, holders)
        # A read-only view, not a copy: the body is the chain's own dict (the Session built it,
        # the pin copied it), and nothing else writes it before the send.
        engine = self._router.choose(call.session_key, engines, MappingProxyType(call.body))
        if engine not in engines:
            raise ConfigurationError(
                f"router {type(self._router).__name__} chose {engine!r}, not one of {list(engines)}",
                check="router",
            )
        if call.ticket is not None:
            call.ticket.engine = engine
        self._router.on_dispatch(engine, call.session_key)
        try:
            return await self._next(call.routed_to(engine))
        except RequestRefusedError:
            if call.binding is not None and self._on_refused:
                self._refused(engine, call.binding)
            raise
        finally:
            self._router.on_complete(engine, call.session_key)

    def _refused(self, engine: str, binding: Binding) -> None:
        for listener in tuple(self._on_refused):
            try:
                listener(engine, binding)
            except Exception:
                logger.exception(
                    "on_refused listener failed",
                    extra={"engine": engine, "version": binding.version_id},
                )

    @staticmethod
    def _unavailable(
        call: EngineCall, healthy: tuple[str, ...], holders: tuple[str, ...]
    ) -> VersionUnavailableError:
        binding = call.binding
        version = binding.version_id if binding is not None else None
        lacking = [e for e in healthy if e not in holders]
        logger.warning(
            "no healthy engine holds the bound version; dispatch refused",
            extra={"version": version, "lacking": lacking, "holders": list(holders)},
        )
        return VersionUnavailableError(
            f"no healthy engine holds version {version!r} right now "
            f"(lacking it: {lacking}; holders: {list(holders)}); it is being loaded onto them "
            "again; nothing was sent",
            version=version,
            lora_name=binding.lora_name if binding is not None else None,
            lacking=lacking,
            holders=list(holders),
            session=call.session_key,
        )


class TransportEndpoint:
    """The end of the chain: one send through the engine transport."""

    def __init__(self, transport: EngineTransport) -> None:
        self._transport = transport

    # Not a coroutine function, like the adapter pin: the send's own coroutine is the step.
    def __call__(self, call: EngineCall) -> Awaitable[EngineReply]:
        if call.engine is None:
            raise ConfigurationError(
                "the chain reached the transport without choosing an engine (no router?)",
                check="router",
            )
        return self._transport.send(call.engine, call.route.value, call.body)
