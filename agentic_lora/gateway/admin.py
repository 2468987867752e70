"""The gateway's admin routes: publish, status, reclaim, resolve, rollback, engines (all behind
the admin token).

The token is compared in constant time (:func:`agentic_lora.foundation.auth.bearer_matches`); without a
configured token every admin route answers 401 ``ACCESS_DENIED`` (``reason="admin_disabled"``).
Bodies are bounded like every other body of the gateway (:mod:`agentic_lora.gateway.limits`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from collections.abc import Awaitable
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING
from typing import Any
from typing import Protocol

from fastapi import Request
from fastapi.responses import JSONResponse
from fastapi.responses import Response
from fastapi.responses import StreamingResponse

from agentic_lora.adapters.snapshot import AdapterSnapshot
from agentic_lora.assembly.membership import DrainResult
from agentic_lora.errors import AccessDeniedError
from agentic_lora.errors import AgenticLoRAError
from agentic_lora.errors import InvalidRequestError
from agentic_lora.foundation.auth import bearer_matches
from agentic_lora.gateway.limits import parse_json
from agentic_lora.gateway.limits import read_body
from agentic_lora.gateway.wire import NDJSON
from agentic_lora.gateway.wire import error_payload
from agentic_lora.gateway.wire import jsonable
from agentic_lora.gateway.wire import phase_event_json
from agentic_lora.gateway.wire import publication_json
from agentic_lora.gateway.wire import reclaim_report_json
from agentic_lora.gateway.wire import resolve_report_json
from agentic_lora.gateway.wire import status_json
from agentic_lora.publication.publisher import PhaseEvent
from agentic_lora.publication.publisher import PublicationResult
from agentic_lora.registry.types import MemberState

if TYPE_CHECKING:
    from agentic_lora.assembly.deployment import Deployment
    from agentic_lora.assembly.metrics import Metrics
    from agentic_lora.gateway.limits import GatewayLimits
    from agentic_lora.gateway.progress import ProgressHub
    from agentic_lora.gateway.sessions import GatewaySessions
    from agentic_lora.session import Versioning

__all__ = ["AdminHost", "AdminRoutes"]

logger = logging.getLogger(__name__)


def _string_field(payload: Mapping[str, Any], name: str) -> str:
    value = payload.get(name)
    if not isinstance(value, str) or not value.strip():
        raise InvalidRequestError(f"`{name}` must be a non-empty string", field=name)
    return value.strip()


def _line(payload: Mapping[str, Any]) -> bytes:
    return json.dumps(jsonable(payload), separators=(",", ":")).encode() + b"\n"


class AdminHost(Protocol):
    """What the admin routes act on: the parts of the gateway that serves them
    (:class:`~agentic_lora.gateway.app.Gateway` is the one). Declared here, so the routes need
    nothing from the module of the gateway that is built around them."""

    @property
    def deployment(self) -> Deployment: ...

    @property
    def versioning(self) -> Versioning: ...

    @property
    def sessions(self) -> GatewaySessions: ...

    @property
    def limits(self) -> GatewayLimits: ...

    @property
    def progress(self) -> ProgressHub: ...

    @property
    def metrics(self) -> Metrics | None: ...


class AdminRoutes:
    """The ``/admin`` handlers of one :class:`~agentic_lora.gateway.app.Gateway`."""

    def __init__(
        self,
        gateway: AdminHost,
        admin_token: str | None,
        on_published: Callable[[PublicationResult], None] | None = None,
    ) -> None:
        self._gateway = gateway
        self._token = admin_token
        self._on_published = on_published  # told every publication's result (the status page)
        # Publications run one at a time anyway (the publisher's lock); holding this one around
        # a whole publication also makes a streamed answer carry only its own progress events.
        self.publish_lock = asyncio.Lock()
        self.background: set[asyncio.Task[Any]] = set()

    def routes(self) -> tuple[tuple[str, Callable[[Request], Awaitable[Response]], str], ...]:
        """Every admin route as (path, endpoint, method); each endpoint checks the token."""
        return (
            ("/admin/publish", self.publish, "POST"),
            ("/admin/status", self.status, "GET"),
            ("/admin/reclaim", self.reclaim, "POST"),
            ("/admin/resolve", self.resolve, "POST"),
            ("/admin/rollback", self.rollback, "POST"),
            ("/admin/engines", self.engines, "GET"),
            ("/admin/engines", self.engines, "POST"),
        )

    def is_admin(self, request: Request) -> bool:
        """Whether ``request`` carries the admin token."""
        return self._token is not None and bearer_matches(
            request.headers.get("authorization"), self._token
        )

    def require_admin(self, request: Request) -> None:
        """Raise ACCESS_DENIED unless ``request`` carries the admin token."""
        if self._token is None:
            raise AccessDeniedError(
                "the admin routes are disabled: start the gateway with an admin token",
                reason="admin_disabled",
            )
        if not self.is_admin(request):
            raise AccessDeniedError(
                "missing or wrong admin token (send `Authorization: Bearer <admin token>`)",
                reason="bad_admin_token",
            )

    async def _payload(self, request: Request, *, optional: bool = False) -> dict[str, Any]:
        limits = self._gateway.limits
        path = request.url.path
        raw = await read_body(request.headers, request.stream(), limits.max_body_bytes, route=path)
        if optional and not raw.strip():
            return {}
        body = parse_json(raw, max_depth=limits.max_json_depth, route=path)
        if not isinstance(body, dict):
            raise InvalidRequestError("the body must be a JSON object", route=path)
        return body

    async def publish(self, request: Request) -> Response:
        """``POST /admin/publish``."""
        self.require_admin(request)
        payload = await self._payload(request)
        adapter_dir = _string_field(payload, "adapter_dir")
        version_id = _string_field(payload, "version_id")
        if not Path(adapter_dir).is_absolute():
            raise InvalidRequestError(
                f"adapter_dir {adapter_dir!r} must be an absolute path on the gateway's host",
                field="adapter_dir",
            )
        if NDJSON in request.headers.get("accept", ""):
            return StreamingResponse(self._stream(adapter_dir, version_id), media_type=NDJSON)
        task = self._spawn(self._publish_now(adapter_dir, version_id, None))
        # Shielded: a client that goes away must not cut a publication short.
        result = await asyncio.shield(task)
        return JSONResponse(publication_json(result))

    def _spawn(self, work: Awaitable[PublicationResult]) -> asyncio.Task[PublicationResult]:
        task = asyncio.ensure_future(work)
        self.background.add(task)

        def done(t: asyncio.Task[PublicationResult]) -> None:
            self.background.discard(t)
            if not t.cancelled():
                t.exception()  # retrieved here, so an abandoned stream never leaves it unseen

        task.add_done_callback(done)
        return task

    async def _publish_now(
        self,
        adapter_dir: str,
        version_id: str,
        listener: Callable[[PhaseEvent], None] | None,
    ) -> PublicationResult:
        gateway = self._gateway
        async with self.publish_lock:
            unsubscribe = gateway.progress.subscribe(listener) if listener is not None else None
            try:
                with self._observed("publication of", version_id):
                    snapshot = await asyncio.to_thread(AdapterSnapshot.from_peft_dir, adapter_dir)
                    result = await gateway.deployment.publish(version_id, snapshot)
            finally:
                if unsubscribe is not None:
                    unsubscribe()
        if gateway.metrics is not None:
            gateway.metrics.observe_publication(result)
        if self._on_published is not None:
            self._on_published(result)
        logger.info(
            "publication of %s: %s",
            version_id,
            result.outcome.value,
            extra={"version": version_id, "attempt": result.attempt},
        )
        return result

    @contextlib.contextmanager
    def _observed(self, what: str, version_id: str) -> Iterator[None]:
        """A publication or rollback that raises is counted (metrics) and logged as it goes."""
        try:
            yield
        except BaseException as exc:
            metrics = self._gateway.metrics
            if metrics is not None and isinstance(exc, Exception):
                metrics.observe_publication_error(exc)
            logger.warning("%s %s failed: %s", what, version_id, exc, extra={"version": version_id})
            raise

    async def _stream(self, adapter_dir: str, version_id: str) -> AsyncIterator[bytes]:
        queue: asyncio.Queue[PhaseEvent | None] = asyncio.Queue()
        task = self._spawn(self._publish_now(adapter_dir, version_id, queue.put_nowait))
        task.add_done_callback(lambda _: queue.put_nowait(None))
        while (event := await queue.get()) is not None:
            yield _line({"event": phase_event_json(event)})
        if task.cancelled():
            yield _line(error_payload(AgenticLoRAError("the publication was cancelled")))
        elif (exc := task.exception()) is not None:
            yield _line(error_payload(exc))
        else:
            yield _line({"result": publication_json(task.result())})

    async def rollback(self, request: Request) -> Response:
        """``POST /admin/rollback``: ``{"version_id": ..., "adapter_dir": ...}`` makes a version
        that was the default before the default again (see :meth:`Deployment.rollback`).
        ``adapter_dir`` (optional, an absolute path on the gateway's host) is the version's
        content, for a reclaimed version the store no longer holds."""
        self.require_admin(request)
        payload = await self._payload(request)
        version_id = _string_field(payload, "version_id")
        adapter_dir = None
        if payload.get("adapter_dir") is not None:
            adapter_dir = _string_field(payload, "adapter_dir")
            if not Path(adapter_dir).is_absolute():
                raise InvalidRequestError(
                    f"adapter_dir {adapter_dir!r} must be an absolute path on the gateway's host",
                    field="adapter_dir",
                )
        # Shielded: a client that goes away must not cut a rollback short.
        result = await asyncio.shield(self._spawn(self._rollback_now(version_id, adapter_dir)))
        return JSONResponse(publication_json(result))

    async def _rollback_now(self, version_id: str, adapter_dir: str | None) -> PublicationResult:
        gateway = self._gateway
        async with self.publish_lock:  # a streamed publication carries only its own events
            with self._observed("rollback to", version_id):
                snapshot = None
                if adapter_dir is not None:
                    snapshot = await asyncio.to_thread(AdapterSnapshot.from_peft_dir, adapter_dir)
                result = await gateway.deployment.rollback(version_id, snapshot)
        if gateway.metrics is not None:
            gateway.metrics.observe_publication(result)
        if self._on_published is not None:
            self._on_published(result)
        commit = result.commit
        logger.warning(
            "rollback to %s: %s",
            version_id,
            result.outcome.value,
            extra={
                "version": version_id,
                "attempt": result.attempt,
                "rolled_back_from": commit.previous_default if commit is not None else None,
                "default_revision": commit.default_revision if commit is not None else None,
            },
        )
        return result

    async def status(self, request: Request) -> Response:
        """``GET /admin/status``."""
        self.require_admin(request)
        gateway = self._gateway
        status = await gateway.deployment.status()
        return JSONResponse(
            {
                "registry": status_json(status),
                "fleet": [
                    {"engine": e.name, "base_url": e.base_url} for e in gateway.versioning.engines
                ],
                "gateway": {
                    "sessions": gateway.sessions.live(),
                    "adopted": gateway.sessions.adopted(),
                },
            }
        )

    async def engines(self, request: Request) -> Response:
        """``GET /admin/engines``: every member and its membership. ``POST /admin/engines``
        with ``{"action": "add" | "drain" | "remove", "engine": NAME}`` changes one (see
        :meth:`Deployment.add_engine`, ``drain_engine``, ``remove_engine``), then answers the
        same list with ``"membership"``: the engine's state after the action. A drain answers
        once the engine's in-flight requests ended and it was removed (or its wait timed out),
        with ``"drain"``: the :class:`~agentic_lora.assembly.membership.DrainResult`."""
        self.require_admin(request)
        deployment = self._gateway.deployment
        body: dict[str, Any] = {}
        if request.method == "POST":
            payload = await self._payload(request)
            action = _string_field(payload, "action")
            engine = _string_field(payload, "engine")
            verbs: dict[str, Callable[[str], Awaitable[MemberState | DrainResult]]] = {
                "add": deployment.add_engine,
                "drain": deployment.drain_engine,
                "remove": deployment.remove_engine,
            }
            verb = verbs.get(action)
            if verb is None:
                raise InvalidRequestError(
                    f"action must be one of {sorted(verbs)}", route="/admin/engines"
                )
            # Shielded: a client that goes away must not cut an add (its loads) or a drain (its
            # wait for the engine's in-flight requests, then the removal) short.
            done = await asyncio.shield(verb(engine))
            drain = done if isinstance(done, DrainResult) else None
            state = done.membership if isinstance(done, DrainResult) else done
            logger.warning(
                "engine membership changed",
                extra={"engine": engine, "action": action, "membership": state.value},
            )
            body = {"engine": engine, "action": action, "membership": state.value}
            if drain is not None:
                body["drain"] = drain.as_json()
        members = await deployment.engines()
        body["engines"] = [
            {"engine": e.engine, "incarnation": e.incarnation, "membership": e.membership.value}
            for e in members
        ]
        return JSONResponse(body)

    async def reclaim(self, request: Request) -> Response:
        """``POST /admin/reclaim``."""
        self.require_admin(request)
        report = await self._gateway.deployment.reclaim()
        return JSONResponse(reclaim_report_json(report))

    async def resolve(self, request: Request) -> Response:
        """``POST /admin/resolve``: the body is optional (no body, ``{}`` or
        ``{"version_id": null}`` resolve everything)."""
        self.require_admin(request)
        payload = await self._payload(request, optional=True)
        version_id = (
            None if payload.get("version_id") is None else _string_field(payload, "version_id")
        )
        # Under the publication lock, so a streamed publication carries only its own events.
        async with self.publish_lock:
            report = await self._gateway.deployment.resolve(version_id)
        logger.info(
            "resolve requested",
            extra={
                "version": version_id,
                "resolved": list(report.resolved),
                "blocked": list(report.blocked),
            },
        )
        return JSONResponse(resolve_report_json(report))
