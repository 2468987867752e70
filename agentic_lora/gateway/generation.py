"""The generation routes of the gateway: one checked request, one Session dispatch.

A request passes, in order: its credentials (:func:`~agentic_lora.gateway.security.caller_of`),
the body limits (:mod:`agentic_lora.gateway.limits`), the route's model
(:mod:`agentic_lora.gateway.schema`) and the model-name check. Only then is its Session opened
(or found), so a refused request never creates or holds one. The dispatch is exactly one
:meth:`~agentic_lora.session.Session.dispatch`, without retry.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncGenerator
from collections.abc import Awaitable
from collections.abc import Callable
from collections.abc import Mapping
from typing import TYPE_CHECKING
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from fastapi.responses import Response

from agentic_lora.errors import AdapterMismatchError
from agentic_lora.errors import AgenticLoRAError
from agentic_lora.errors import RequestIndeterminateError
from agentic_lora.errors import TooManySessionsError
from agentic_lora.errors import error_code
from agentic_lora.foundation.requests import Route
from agentic_lora.gateway.limits import GatewayLimits
from agentic_lora.gateway.limits import parse_json
from agentic_lora.gateway.limits import read_body
from agentic_lora.gateway.schema import RequestModels
from agentic_lora.gateway.schema import validate_body
from agentic_lora.gateway.security import SessionTagger
from agentic_lora.gateway.session_header import SessionHeaders
from agentic_lora.gateway.sessions import GatewaySessions
from agentic_lora.gateway.streaming import SSEResponse
from agentic_lora.gateway.streaming import sse_events
from agentic_lora.gateway.wire import OUTCOME_HEADER
from agentic_lora.gateway.wire import SHOULD_RETRY_HEADER
from agentic_lora.gateway.wire import DispatchOutcome
from agentic_lora.gateway.wire import classify_failure
from agentic_lora.gateway.wire import error_payload
from agentic_lora.gateway.wire import http_status
from agentic_lora.gateway.wire import should_retry
from agentic_lora.registry.provenance import TurnProvenance
from agentic_lora.registry.types import Binding
from agentic_lora.session import Session
from agentic_lora.session.streaming import StreamChunk

if TYPE_CHECKING:
    from agentic_lora.assembly.deployment import Deployment
    from agentic_lora.assembly.metrics import Metrics

__all__ = ["PROVENANCE_FIELD", "GenerationRoutes", "error_response"]

logger = logging.getLogger("agentic_lora.gateway.app")  # one logger name for every route

_VERSION_HEADER = "x-agentic-version"
_LORA_HEADER = "x-agentic-lora-name"
_ENGINE_HEADER = "x-agentic-engine"
# Trajectory provenance of each reply (also in the body's ``agentic_lora`` field).
_DIGEST_HEADER = "x-agentic-digest"
_REVISION_AT_BIND_HEADER = "x-agentic-revision-at-bind"
_LAG_HEADER = "x-agentic-version-lag"
_ROLLED_BACK_FROM_HEADER = "x-agentic-rolled-back-from"
#: The extension field a JSON object reply carries its turn's provenance in.
PROVENANCE_FIELD = "agentic_lora"


def error_response(
    exc: BaseException, *, outcome: DispatchOutcome | None = None, status: int | None = None
) -> JSONResponse:
    headers = {SHOULD_RETRY_HEADER: "true" if should_retry(exc) else "false"}
    if outcome is not None:
        headers[OUTCOME_HEADER] = outcome.value
    if isinstance(exc, TooManySessionsError):
        headers["retry-after"] = str(math.ceil(float(exc.details.get("retry_after", 60))))
    return JSONResponse(error_payload(exc), status_code=status or http_status(exc), headers=headers)


class GenerationRoutes:
    """The generation handlers; :class:`~agentic_lora.gateway.app.Gateway` provides the state."""

    deployment: Deployment
    metrics: Metrics | None
    sessions: GatewaySessions
    limits: GatewayLimits
    _models: RequestModels
    _tagger: SessionTagger
    _admin_token: str | None
    _session_headers: SessionHeaders

    # --- generation -----------------------------------------------------------------------------

    def _generation_endpoint(self, route: Route) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            return await self._generate(route, request)

        return endpoint

    async def _generate(self, route: Route, request: Request) -> Response:
        session: Session | None = None
        session_id: str | None = None
        stream: AsyncGenerator[StreamChunk, None] | None = None
        try:
            session_id = self._session_headers.session_id(request.headers)
            body = await self._checked_body(route, request)
            # Only a request that passed every check reaches this line: no other may open or
            # hold a Session (a refused one leaves nothing behind).
            session = await self.sessions.open(session_id)
            if body.get("stream") is True:
                stream = session.stream(route, body)
                # The first chunk before the answer starts: a failure until then is an ordinary
                # error answer, classified as for a request that does not stream.
                first = await anext(stream, None)
            else:
                reply = await session.dispatch(route, body)
        except Exception as exc:
            return self._dispatch_failed(route, session_id, session, exc)
        finally:
            if session_id is not None and session is not None:
                self.sessions.touch(session_id)
        binding = session.binding
        assert binding is not None  # a versioned dispatch that returned was bound
        if stream is not None:
            return self._streamed(route, session_id, session, first, stream)
        self._log_ok(route, session_id, binding, reply.engine)
        headers = self._reply_headers(binding, reply.engine, reply.provenance)
        body = reply.body
        turn = reply.provenance
        if turn is not None and isinstance(body, Mapping):
            # A copy: the reply object stays exactly what the engine answered.
            body = {**body, PROVENANCE_FIELD: turn.to_dict()}
        try:
            return JSONResponse(body, status_code=reply.status_code, headers=headers)
        except (ValueError, TypeError, RecursionError) as exc:
            # The engine ran it, but its reply cannot be carried as JSON (NaN, too deep).
            failure = RequestIndeterminateError(
                "the engine's reply cannot be sent on as JSON; the generation may have run",
                engine=reply.engine,
                reason="reply_not_json",
            )
            failure.__cause__ = exc
            return self._dispatch_failed(route, session_id, session, failure)

    def _log_ok(self, route: Route, session_id: str, binding: Binding, engine: str) -> None:
        logger.info(
            "dispatch ok",
            extra={
                "session": self.sessions.tag(session_id),
                "version": binding.version_id,
                "engine": engine,
                "attempt": 1,
                "route": route.value,
            },
        )

    @staticmethod
    def _reply_headers(
        binding: Binding, engine: str, turn: TurnProvenance | None
    ) -> dict[str, str]:
        headers = {
            _VERSION_HEADER: binding.version_id,
            _LORA_HEADER: binding.lora_name,
            _ENGINE_HEADER: engine,
            OUTCOME_HEADER: DispatchOutcome.OK.value,
        }
        if turn is not None:
            headers[_DIGEST_HEADER] = turn.digest_prefix
            headers[_REVISION_AT_BIND_HEADER] = str(turn.default_revision_at_bind)
            if turn.lag is not None:
                headers[_LAG_HEADER] = str(turn.lag)
            if turn.rolled_back_from is not None:
                headers[_ROLLED_BACK_FROM_HEADER] = turn.rolled_back_from
        return headers

    def _streamed(
        self,
        route: Route,
        session_id: str,
        session: Session,
        first: StreamChunk | None,
        stream: AsyncGenerator[StreamChunk, None],
    ) -> Response:
        binding = session.binding
        assert binding is not None
        engine = first.engine if first is not None else ""
        self._log_ok(route, session_id, binding, engine)

        def on_end(error: BaseException | None) -> None:
            self.sessions.touch(session_id)
            if error is not None:
                # After the first chunk: the partial output went out, the failure is its last
                # event (the status line was sent long ago).
                self._log_failure(route, session_id, session, error)

        headers = self._reply_headers(binding, engine, first.provenance if first else None)
        events = sse_events(route, first, stream, PROVENANCE_FIELD, on_end)
        return SSEResponse(events, headers={**headers, "cache-control": "no-cache"})

    async def _checked_body(self, route: Route, request: Request) -> dict[str, Any]:
        """The body, once it passed the limits, the route's model and the model-name check."""
        limits = self.limits
        raw = await read_body(
            request.headers, request.stream(), limits.max_body_bytes, route=route.value
        )
        body = parse_json(raw, max_depth=limits.max_json_depth, route=route.value)
        checked = validate_body(self._models, route, body)
        settings = self.deployment.settings
        base, prefix = settings.base_model_name, settings.lora_name_prefix
        # The Session's own adapter is checked after the bind; a name that can be no Session's
        # adapter is refused now, before one is opened for it.
        model, lora_path = checked.get("model"), checked.get("lora_path")
        adapter = str(model).removeprefix(f"{base}:") if model is not None else ""
        if (
            base is not None
            and model is not None
            and model != base
            and not adapter.startswith(prefix)
        ):
            raise AdapterMismatchError(
                f"`model` must be the served base model {base!r} (or the Session's adapter)",
                given=model[:300],
                reason="unknown_model",
            )
        if lora_path is not None and not lora_path.startswith(prefix):
            raise AdapterMismatchError(
                "`lora_path` names no adapter this gateway publishes (leave it out)",
                given=lora_path[:300],
                reason="unknown_model",
            )
        return checked

    def _dispatch_failed(
        self, route: Route, session_id: str | None, session: Session | None, exc: BaseException
    ) -> Response:
        outcome = self._log_failure(route, session_id, session, exc)
        return error_response(exc, outcome=outcome)

    def _log_failure(
        self, route: Route, session_id: str | None, session: Session | None, exc: BaseException
    ) -> DispatchOutcome:
        # Past session.open the request may have reached an engine; an untyped failure there
        # is therefore indeterminate (typed errors say for themselves).
        outcome = classify_failure(exc, sent=session is not None)
        binding = session.binding if session is not None else None
        details = exc.details if isinstance(exc, AgenticLoRAError) else {}
        extra = {
            "session": self._tagger.tag(session_id) if session_id is not None else None,
            "version": binding.version_id if binding is not None else None,
            "engine": details.get("engine"),
            "attempt": 1,
            "route": route.value,
            "outcome": outcome.value,
            "code": error_code(exc),
        }
        if self.metrics is not None:
            self.metrics.observe_refused_request(exc)
        # The code, never the message: messages may quote the Session id (the credential).
        if isinstance(exc, AgenticLoRAError):
            logger.warning("dispatch %s: %s", outcome.value, exc.code, extra=extra)
        else:
            logger.error("dispatch failed unexpectedly", exc_info=exc, extra=extra)
        return outcome
