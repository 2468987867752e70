"""The chain's core types: the call that travels down it, the shape of one step, and how the
steps are stacked.

:class:`EngineCall` is one request on its way to an engine; a :data:`Dispatch` takes one and
returns the engine's :class:`~agentic_lora.engines.transport.EngineReply`. :class:`Middleware` is
a middleware class with its options, built around the next step by :func:`build_chain`.
"""

from __future__ import annotations

from collections.abc import Awaitable
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field
from typing import Any

from agentic_lora.engines.transport import EngineReply
from agentic_lora.foundation.requests import Route
from agentic_lora.registry.types import Binding
from agentic_lora.session.in_flight import InFlight

__all__ = ["Dispatch", "EngineCall", "Middleware", "build_chain"]


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
"""One step of the chain: ``await dispatch(call)`` is the engine's reply to ``call``."""


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
