"""The generation routes as plain ASGI, in front of the gateway's FastAPI app.

A generation request is the gateway's hot path: every agent turn is one. FastAPI's route
matching, dependency solving and middleware stack cost more CPU per request than every check
the gateway itself makes on it, and a generation route uses none of them: its handler reads the
raw request and catches its own failures (:mod:`agentic_lora.gateway.generation`). So
:class:`GenerationFastPath` answers ``POST`` on the three generation paths itself and hands
every other request, unchanged, to the FastAPI app.

What stays the same on the fast path:

* the handler is the one the FastAPI route calls, so its checks, in their order (credentials,
  body limits, schema, model name, then the Session), and its answers are the same;
* a typed error that escapes the handler answers as the FastAPI app's handler would
  (:func:`~agentic_lora.gateway.generation.error_response`), and any other exception propagates
  to the server, which answers 500 as Starlette's outermost layer would;
* the routes stay declared on the FastAPI app, so ``/openapi.json`` documents them, and a request
  the fast path does not take (another method, a trailing slash, a ``root_path`` mount) gets the
  FastAPI app's answer (405, redirect, ...).

FastAPI's optional OpenTelemetry instrumentation does not see the generation routes (the gateway
does not configure it; its own metrics count every dispatch).
"""

from __future__ import annotations

from collections.abc import Awaitable
from collections.abc import Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp
from starlette.types import Receive
from starlette.types import Scope
from starlette.types import Send

from agentic_lora.errors import AgenticLoRAError
from agentic_lora.foundation.requests import Route
from agentic_lora.gateway.generation import error_response

__all__ = ["GenerationFastPath"]

#: One generation: the route and the request, to the answer.
Handler = Callable[[Route, Request], Awaitable[Response]]


class GenerationFastPath:
    """ASGI app: ``POST`` on a generation path goes to ``handler``, anything else to ``app``."""

    def __init__(self, app: ASGIApp, handler: Handler) -> None:
        self.app = app
        self._handler = handler
        self._routes = {route.value: route for route in Route}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = (
            self._routes.get(scope["path"])
            if scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path")
            else None
        )
        if route is None:
            await self.app(scope, receive, send)
            return
        try:
            response = await self._handler(route, Request(scope, receive))
        except AgenticLoRAError as exc:
            response = error_response(exc)
        await response(scope, receive, send)
