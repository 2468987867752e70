"""The dispatch guard: the middleware that refuses, locally, a version that may no longer reach an
engine, and the guard it asks.

:class:`DispatchGuardMiddleware` refuses a version that is reclaiming or gone: an engine would
otherwise reload it from its old path and resurrect it behind the registry's back. It also hands
on which engines hold the version right now (``EngineCall.engines``: an engine that restarted
holds nothing until the repairer loaded the version onto it again), and counts every request it
lets through per adapter (:class:`~agentic_lora.session.in_flight.AdapterInFlight`), so a reclaim
on an engine whose unload does not wait for in-flight requests (vLLM) can wait for them.

A :class:`DispatchGuard` answers without I/O; :class:`PeekGuard` is the one over the registry's
synchronous read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol
from typing import runtime_checkable

from agentic_lora.engines.transport import EngineReply
from agentic_lora.errors import VersionNotDispatchableError
from agentic_lora.registry.api import in_process_core
from agentic_lora.registry.api import peeker
from agentic_lora.registry.types import Binding
from agentic_lora.registry.types import DispatchView
from agentic_lora.registry.types import VersionStatus
from agentic_lora.session.in_flight import AdapterInFlight
from agentic_lora.session.middleware.chain import Dispatch
from agentic_lora.session.middleware.chain import EngineCall

__all__ = ["DispatchGuard", "DispatchGuardMiddleware", "PeekGuard"]


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
    holding the version), for
    :class:`~agentic_lora.session.middleware.routing.RoutingMiddleware`. With ``in_flight``,
    every request it lets through is counted on its adapter until it ends.
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
