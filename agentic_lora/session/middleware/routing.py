"""Routing: the middleware that lets the router pick the engine a call goes to.

:class:`RoutingMiddleware` lets the router pick one of the healthy engines that hold the version
(it sees a read-only body); none: :class:`~agentic_lora.errors.VersionUnavailableError` before
anything is sent. An engine's refusal of a versioned request is reported to the ``on_refused``
listeners (:data:`RefusedListener`; the repairer probes at once instead of at its next tick).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from collections.abc import Sequence
from types import MappingProxyType

from agentic_lora.engines.routing import EngineHealth
from agentic_lora.engines.routing import Router
from agentic_lora.engines.transport import EngineReply
from agentic_lora.errors import ConfigurationError
from agentic_lora.errors import RequestRefusedError
from agentic_lora.errors import VersionUnavailableError
from agentic_lora.registry.types import Binding
from agentic_lora.session.in_flight import AdapterInFlight
from agentic_lora.session.middleware.chain import Dispatch
from agentic_lora.session.middleware.chain import EngineCall

__all__ = ["RefusedListener", "RoutingMiddleware"]

logger = logging.getLogger(__name__)

RefusedListener = Callable[[str, Binding], object]
"""``listener(engine, binding)``: ``engine`` refused a request of a Session bound to ``binding``.

Called synchronously on the dispatch path, so it must only note or schedule (poke a repairer,
start a refresh); an exception it raises is logged and never reaches the caller.
"""


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

    ``in_flight``: counts every request per engine from the moment it was routed until it ended
    (a stream: until the stream ended). Counted in the same step as the dispatch guard's read of
    the holders (no await between them), so once a membership change that takes an engine out of
    the holders was applied, no request of this process starts on it, and the count reaching
    zero means every one sent to it ended (how a drain knows when to remove the engine).
    """

    def __init__(
        self,
        next_dispatch: Dispatch,
        *,
        router: Router,
        health: EngineHealth,
        on_refused: Sequence[RefusedListener] = (),
        in_flight: AdapterInFlight | None = None,
    ) -> None:
        self._next = next_dispatch
        self._in_flight = in_flight
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
        counts = self._in_flight
        if counts is not None:
            counts.enter(engine)
        try:
            return await self._next(call.routed_to(engine))
        except RequestRefusedError:
            if call.binding is not None and self._on_refused:
                self._refused(engine, call.binding)
            raise
        finally:
            if counts is not None:
                counts.leave(engine)
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
