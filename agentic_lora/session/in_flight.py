"""What is in flight: each dispatch while it runs, and the requests per adapter (or per engine)
with an event-driven wait for one of them to drain.

:class:`InFlight` is a Session's record of one dispatch (its request id, then its engine), kept
until the dispatch ended so that a close can abort it.

:class:`~agentic_lora.session.middleware.DispatchGuardMiddleware` counts every request it lets
through; a backend whose engine does not wait for in-flight requests on unload (vLLM) waits for
the count to reach zero before it unloads a version (see
:meth:`agentic_lora.session.Versioning.wait_drained`).
:class:`~agentic_lora.session.middleware.RoutingMiddleware` counts every request it sends per
engine in a second counter of the same kind; a drained engine is removed once its count reached
zero (see :meth:`agentic_lora.session.Versioning.wait_engine_drained`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from collections.abc import Iterator
from dataclasses import dataclass

from agentic_lora.foundation.listeners import notify

__all__ = ["AdapterInFlight", "DrainWaitListener", "InFlight"]

logger = logging.getLogger(__name__)


@dataclass(eq=False, slots=True)
class InFlight:
    """One dispatch while it runs: its request id and, once routed, its engine (for abort)."""

    rid: str | None
    engine: str | None = None


DrainWaitListener = Callable[[str, int], object]
"""``listener(lora_name, in_flight)``: a drain wait on ``lora_name`` started with ``in_flight``
requests still running (see :attr:`AdapterInFlight.on_wait`); an exception it raises is logged."""


class AdapterInFlight:
    """Requests in flight per adapter (lora name), with an event-driven wait for one to drain.

    :class:`~agentic_lora.session.middleware.DispatchGuardMiddleware` counts a request from the
    moment it passed the guard until its reply (or failure) is back. :meth:`wait_drained` is what
    a backend awaits before unloading a version from an engine whose unload does not wait for its
    own in-flight requests (vLLM).
    """

    def __init__(self, *, label: str = "version") -> None:
        #: What a name counted here is (the ``extra=`` key of the wait's log line).
        self._label = label
        self._counts: dict[str, int] = {}
        # At most one event per busy name, created by the first waiter of a busy period and set
        # when the count returns to zero: a waiter never sees a later busy period's event, so it
        # cannot miss its wake-up (and a busy period nobody waits for costs no event).
        self._drained: dict[str, asyncio.Event] = {}
        #: Told ``(lora_name, in_flight)`` when a :meth:`wait_drained` starts waiting for busy
        #: requests (never when it returns at once); append listeners at any time.
        self.on_wait: list[DrainWaitListener] = []

    def count(self, lora_name: str) -> int:
        """Requests on ``lora_name`` in flight now."""
        return self._counts.get(lora_name, 0)

    def busy(self) -> dict[str, int]:
        """Every adapter with requests in flight, and how many."""
        return dict(self._counts)

    @contextlib.contextmanager
    def track(self, lora_name: str) -> Iterator[None]:
        """Count one request on ``lora_name`` for the duration of the block."""
        self.enter(lora_name)
        try:
            yield
        finally:
            self.leave(lora_name)

    def enter(self, lora_name: str) -> None:
        """Count one request on ``lora_name`` (pair it with :meth:`leave` in a ``finally``;
        :meth:`track` does both, at the cost of a generator per request)."""
        counts = self._counts
        counts[lora_name] = counts.get(lora_name, 0) + 1

    def leave(self, lora_name: str) -> None:
        """The request counted by :meth:`enter` ended."""
        left = self._counts[lora_name] - 1
        if left:
            self._counts[lora_name] = left
        else:
            del self._counts[lora_name]
            drained = self._drained.pop(lora_name, None)
            if drained is not None:
                drained.set()

    async def wait_drained(self, lora_name: str) -> None:
        """Return at the first moment no request on ``lora_name`` is in flight (now if none is).

        Call it once the version can no longer be dispatched (RECLAIMING): then no request on it
        starts after the call, and the return means every one of them ended.
        """
        in_flight = self._counts.get(lora_name, 0)
        if not in_flight:
            return
        event = self._drained.get(lora_name)
        if event is None:
            event = self._drained[lora_name] = asyncio.Event()
        extra = {self._label: lora_name, "in_flight": in_flight}
        logger.info("waiting for requests on %s to end", lora_name, extra=extra)
        notify(self.on_wait, lora_name, in_flight, logger=logger, what="on_wait", extra=extra)
        await event.wait()
