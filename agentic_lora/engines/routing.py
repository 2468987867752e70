"""The router plugin contract: which engine of the fixed fleet serves a new dispatch.

A router only chooses. It gets a read-only view of the request body, never changes it (the bound
``lora_path`` travels untouched) and never sends anything, so it cannot resend either. The
dispatch chain calls :meth:`Router.on_dispatch` right before a request goes out and
:meth:`Router.on_complete` once it has ended, however it ended, so load-aware routers can count
requests in flight.

Engine health is kept outside the router (:class:`EngineHealth`): the chain offers a router only
the engines currently healthy, so an affinity router keeps a Session where it is until that engine
is marked unhealthy.

Plugins register under the entry-point group ``agentic_lora.routers``; :func:`load_router`
finds one by name.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any
from typing import Protocol
from typing import runtime_checkable

from agentic_lora.errors import ConfigurationError
from agentic_lora.foundation.discovery import ROUTERS_GROUP
from agentic_lora.foundation.discovery import build_plugin

__all__ = [
    "EngineHealth",
    "InFlightCounter",
    "Router",
    "available_routers",
    "load_router",
]


@runtime_checkable
class Router(Protocol):
    """Chooses one engine for a dispatch; counts what is in flight."""

    def choose(
        self, session_key: str | None, engines: Sequence[str], request: Mapping[str, Any]
    ) -> str:
        """Return one of ``engines`` (never empty) for this request of this Session."""
        ...

    def on_dispatch(self, engine: str, session_key: str | None) -> None:
        """A request is about to be sent to ``engine``."""
        ...

    def on_complete(self, engine: str, session_key: str | None) -> None:
        """A request sent to ``engine`` has ended (answered, failed or cancelled)."""
        ...


class InFlightCounter:
    """Counts requests in flight per engine; a base for routers that balance load."""

    def __init__(self) -> None:
        self._in_flight: Counter[str] = Counter()

    def in_flight(self, engine: str) -> int:
        """Requests currently in flight on ``engine``."""
        return self._in_flight[engine]

    def on_dispatch(self, engine: str, session_key: str | None) -> None:
        """Count one more request on ``engine``."""
        self._in_flight[engine] += 1

    def on_complete(self, engine: str, session_key: str | None) -> None:
        """Count one request less on ``engine``."""
        if self._in_flight[engine] <= 0:
            raise RuntimeError(f"on_complete for {engine!r} without a matching on_dispatch")
        self._in_flight[engine] -= 1


class EngineHealth:
    """Which engines of the fleet may receive new dispatches."""

    def __init__(self, engines: Iterable[str]) -> None:
        self._fleet = tuple(engines)
        self._unhealthy: set[str] = set()
        # Read on every dispatch, changed only on a health event: kept, not rebuilt per read.
        self._healthy = self._fleet

    def _known(self, engine: str) -> None:
        if engine not in self._fleet:
            raise ConfigurationError(
                f"engine {engine!r} is not in the fleet {list(self._fleet)}", check="unknown_engine"
            )

    def mark_unhealthy(self, engine: str) -> None:
        """Stop routing new dispatches to ``engine``."""
        self._known(engine)
        self._unhealthy.add(engine)
        self._refresh()

    def mark_healthy(self, engine: str) -> None:
        """Route to ``engine`` again."""
        self._known(engine)
        self._unhealthy.discard(engine)
        self._refresh()

    def _refresh(self) -> None:
        self._healthy = tuple(e for e in self._fleet if e not in self._unhealthy)

    def is_healthy(self, engine: str) -> bool:
        """Whether ``engine`` may receive new dispatches."""
        return engine in self._fleet and engine not in self._unhealthy

    def healthy(self) -> tuple[str, ...]:
        """The healthy engines, in fleet order."""
        return self._healthy


def available_routers() -> tuple[str, ...]:
    """Names of the installed router plugins."""
    from agentic_lora.foundation.discovery import plugin_names

    return plugin_names(ROUTERS_GROUP)


def load_router(name: str, **options: Any) -> Router:
    """Instantiate the router plugin registered as ``name`` with ``options``."""
    router: Router = build_plugin(ROUTERS_GROUP, name, Router, options)
    return router
