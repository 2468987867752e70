"""The dispatch chain: small middlewares, each wrapping the next, ending at the engine transport.

A :data:`Dispatch` takes an :class:`EngineCall` and returns an
:class:`~agentic_lora.engines.transport.EngineReply`. A middleware is a class built as
``Middleware(next_dispatch, **options)`` whose instances are themselves a ``Dispatch`` (the shape
of a Starlette middleware). :func:`build_chain` stacks them; the first one listed runs first.

For a versioned Session the chain is::

    framework middleware ... -> AdapterPinMiddleware -> DispatchGuardMiddleware
        -> RoutingMiddleware -> TransportEndpoint

* :class:`AdapterPinMiddleware` writes the Session's bound adapter into the body the engine
  dialect's way, and refuses a caller that named another adapter;
* :class:`DispatchGuardMiddleware` refuses, locally, a version that is reclaiming or gone, hands
  on which engines hold it right now, and counts every request it lets through per adapter;
* :class:`RoutingMiddleware` lets the router pick one of the healthy engines that hold the
  version, and tells its ``on_refused`` listeners when an engine refused a versioned request;
* :class:`TransportEndpoint` sends once.

Framework middlewares run before the pin, so whatever they put in the body is checked against the
binding, never trusted.

One module per job, each saying what its middleware guarantees:
:mod:`~agentic_lora.session.middleware.chain` (the call, the step and how steps are stacked),
:mod:`~agentic_lora.session.middleware.adapter_pin`,
:mod:`~agentic_lora.session.middleware.dispatch_guard`,
:mod:`~agentic_lora.session.middleware.routing` and
:mod:`~agentic_lora.session.middleware.endpoint`. Every public name is importable from this
package; the in-flight records (:class:`InFlight`, :class:`AdapterInFlight`) are declared in
:mod:`agentic_lora.session.in_flight` and exported here too.
"""

from __future__ import annotations

from agentic_lora.session.in_flight import AdapterInFlight
from agentic_lora.session.in_flight import DrainWaitListener
from agentic_lora.session.in_flight import InFlight
from agentic_lora.session.middleware.adapter_pin import AdapterPinMiddleware
from agentic_lora.session.middleware.adapter_pin import pin_adapter
from agentic_lora.session.middleware.chain import Dispatch
from agentic_lora.session.middleware.chain import EngineCall
from agentic_lora.session.middleware.chain import Middleware
from agentic_lora.session.middleware.chain import build_chain
from agentic_lora.session.middleware.dispatch_guard import DispatchGuard
from agentic_lora.session.middleware.dispatch_guard import DispatchGuardMiddleware
from agentic_lora.session.middleware.dispatch_guard import PeekGuard
from agentic_lora.session.middleware.endpoint import TransportEndpoint
from agentic_lora.session.middleware.routing import RefusedListener
from agentic_lora.session.middleware.routing import RoutingMiddleware

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
