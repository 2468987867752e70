"""The Session gateway: one Deployment behind an OpenAI-compatible HTTP API.

Routes (see ``docs/gateway.md`` for the full contract):

| route | who | what |
| --- | --- | --- |
| `POST /v1/chat/completions`, `POST /v1/completions`, `POST /generate` | agents | one generation in the caller's Session |
| `GET /v1/models` | agents | the served base model |
| `POST /v1/sessions/{id}/close` | frameworks | end a Session: drain, release exactly once |
| `POST /admin/publish`, `GET /admin/status`, `POST /admin/reclaim`, `POST /admin/resolve` | operators | behind the admin token |
| `GET /metrics` | monitoring | Prometheus text |
| `GET /health/live` (alias `GET /health`), `GET /health/ready` | monitoring | liveness; readiness |

A generation is exactly one :meth:`~agentic_lora.session.Session.dispatch`: the gateway adds no
retry, and every failure answers with the error's stable code, an ``X-Agentic-Outcome`` of
``refused`` or ``indeterminate``, and ``x-should-retry: false`` unless resending is provably safe.
Streaming is refused (``INVALID_REQUEST``, 400): a versioned Session does not stream yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from agentic_lora.adapter import AdapterSnapshot
from agentic_lora.config import AgenticLoRASettings
from agentic_lora.deployment import Deployment
from agentic_lora.errors import (
    AccessDeniedError,
    AgenticLoRAError,
    ConfigurationError,
    InvalidRequestError,
)
from agentic_lora.gateway.progress import ProgressHub
from agentic_lora.gateway.sessions import GatewaySessions, session_id_from_headers
from agentic_lora.gateway.wire import (
    NDJSON,
    OUTCOME_HEADER,
    SHOULD_RETRY_HEADER,
    DispatchOutcome,
    classify_failure,
    error_payload,
    http_status,
    jsonable,
    phase_event_json,
    publication_json,
    reclaim_report_json,
    resolve_report_json,
    should_retry,
    status_json,
)
from agentic_lora.publisher import PhaseEvent, PublicationResult
from agentic_lora.requests import Route
from agentic_lora.session import Session, Versioning

if TYPE_CHECKING:
    from agentic_lora.backends import Backend
    from agentic_lora.metrics import Metrics

__all__ = ["Gateway"]

logger = logging.getLogger(__name__)

_VERSION_HEADER = "x-agentic-version"
_LORA_HEADER = "x-agentic-lora-name"
_ENGINE_HEADER = "x-agentic-engine"
# Trajectory provenance of each reply (also in the body's ``agentic_lora`` field).
_DIGEST_HEADER = "x-agentic-digest"
_REVISION_AT_BIND_HEADER = "x-agentic-revision-at-bind"
_LAG_HEADER = "x-agentic-version-lag"
#: The extension field a JSON object reply carries its turn's provenance in.
PROVENANCE_FIELD = "agentic_lora"


def _error_response(
    exc: BaseException, *, outcome: DispatchOutcome | None = None, status: int | None = None
) -> JSONResponse:
    headers = {SHOULD_RETRY_HEADER: "true" if should_retry(exc) else "false"}
    if outcome is not None:
        headers[OUTCOME_HEADER] = outcome.value
    return JSONResponse(error_payload(exc), status_code=status or http_status(exc), headers=headers)


async def _json_object(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = json.loads(raw) if raw else None
    except ValueError as exc:
        raise InvalidRequestError(
            f"the body is not valid JSON: {exc}", route=request.url.path
        ) from exc
    if not isinstance(body, dict):
        raise InvalidRequestError("the body must be a JSON object", route=request.url.path)
    return body


def _string_field(payload: Mapping[str, Any], name: str) -> str:
    value = payload.get(name)
    if not isinstance(value, str) or not value.strip():
        raise InvalidRequestError(f"`{name}` must be a non-empty string", field=name)
    return value.strip()


class Gateway:
    """The HTTP face of one :class:`~agentic_lora.deployment.Deployment`.

    Build it with :meth:`from_settings` (it wires metrics and progress into the deployment),
    or around an existing deployment. ``app`` is the ASGI application. Use ``async with
    gateway:`` (or :meth:`start` / :meth:`aclose`) around serving it: that runs the background
    reclaimer and the idle-Session expiry, and closes every Session at the end.

    * ``admin_token``: the bearer token of the ``/admin`` routes (None: they are disabled).
    * ``metrics``: instruments to serve on ``/metrics`` (their observers must already be hooked
      into the deployment, as :meth:`from_settings` does).
    * ``progress``: the hub the deployment reports progress to (its ``on_progress``); a streamed
      publication listens on it.
    * ``idle_timeout``: close Sessions unused this many seconds (None: never).
    * ``reuse_closed_ids``: let a closed Session id open a new Session (default: refused).
    """

    def __init__(
        self,
        deployment: Deployment,
        *,
        admin_token: str | None = None,
        metrics: Metrics | None = None,
        progress: ProgressHub | None = None,
        idle_timeout: float | None = None,
        reuse_closed_ids: bool = False,
        clock: Callable[[], float] = time.monotonic,
        owns_deployment: bool = False,
    ) -> None:
        if idle_timeout is not None and idle_timeout <= 0:
            raise ConfigurationError("idle_timeout must be positive", check="idle_timeout")
        if admin_token is not None and not admin_token.strip():
            raise ConfigurationError("the admin token must not be empty", check="admin_token")
        self.deployment = deployment
        self.metrics = metrics
        self.progress = progress if progress is not None else ProgressHub()
        self.idle_timeout = idle_timeout
        # Session ids are durable names in the registry, held under the Versioning's owner lease
        # (from_settings makes it the gateway's: owner gateway_id, adopt on restart).
        self.sessions = GatewaySessions(
            deployment.versioning,
            lease=deployment.versioning.lease,
            clock=clock,
            reuse_closed_ids=reuse_closed_ids,
            deployment_epoch=deployment.settings.deployment_epoch,
        )
        self._admin_token = admin_token
        self._owns_deployment = owns_deployment
        # Publications run one at a time anyway (the publisher's lock); holding this one around
        # a whole publication also makes a streamed answer carry only its own progress events.
        self._publish_lock = asyncio.Lock()
        self._background: set[asyncio.Task[Any]] = set()
        self._reaper: asyncio.Task[None] | None = None
        self.app = self._build_app()

    @classmethod
    async def from_settings(
        cls,
        settings: AgenticLoRASettings,
        *,
        backend_options: Mapping[str, Any] | None = None,
        backend: Backend | None = None,
        admin_token: str | None = None,
        idle_timeout: float | None = None,
        reuse_closed_ids: bool = False,
        with_metrics: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> Gateway:
        """Registry, Sessions, publisher, reclaimer and backend from settings, instrumented.

        The deployment gets a :class:`ProgressHub` as its progress callback and, with
        ``with_metrics``, a dispatch-counting middleware, a registry listener and a metrics
        listener on the hub. The gateway owns the deployment (closed by :meth:`aclose`). Its
        Sessions bind under the owner lease of ``settings.gateway_id`` with
        ``on_restart="adopt"`` (see :mod:`agentic_lora.gateway.sessions`).
        ``clock`` only measures Session idleness.
        """
        if not settings.enable_versioned_lora_publication:
            raise ConfigurationError(
                "the gateway serves versioned Sessions: enable --enable-versioned-lora-publication",
                check="flag",
            )
        metrics: Metrics | None = None
        progress = ProgressHub()
        if with_metrics:
            from agentic_lora.metrics import Metrics

            metrics = Metrics()
            progress.subscribe(metrics.observe_phase)
        # One construction path for every engine kind (a vLLM backend gets the Sessions' drain hook).
        deployment = Deployment.from_settings(
            settings,
            backend=backend,
            backend_options=backend_options,
            middleware=[metrics.dispatch_middleware()] if metrics else (),
            on_progress=progress,
            # One owner per gateway (replica), stable across its restarts: a restarted gateway
            # adopts its predecessor's Sessions, whose agents outlive it.
            lease_owner=settings.gateway_id,
            lease_on_restart="adopt",
        )
        if metrics is not None:
            metrics.watch_registry(deployment.registry)
            metrics.watch_staleness(deployment.versioning)
        return cls(
            deployment,
            admin_token=admin_token,
            metrics=metrics,
            progress=progress,
            idle_timeout=idle_timeout,
            reuse_closed_ids=reuse_closed_ids,
            clock=clock,
            owns_deployment=True,
        )

    @property
    def versioning(self) -> Versioning:
        """The deployment's Session manager."""
        return self.deployment.versioning

    # --- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the background reclaimer, open the gateway's owner lease (a restarted gateway
        adopts its predecessor's Sessions here) and, with ``idle_timeout``, the idle-Session
        expiry."""
        await self.deployment.start()
        await self.sessions.start()  # opens the lease: a restart adopts its Sessions now
        if self.idle_timeout is not None and self._reaper is None:
            self._reaper = asyncio.get_running_loop().create_task(
                self._reap_forever(self.idle_timeout), name="gateway idle sessions"
            )

    async def aclose(self) -> None:
        """Stop the expiry, let running publications finish, close the deployment if owned."""
        reaper, self._reaper = self._reaper, None
        if reaper is not None:
            reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reaper
        if self._background:
            # A publication is never cut short: it would leave a version LOADING.
            await asyncio.wait(set(self._background))
        if self._owns_deployment:
            await self.deployment.aclose()

    async def __aenter__(self) -> Gateway:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def _reap_forever(self, idle_for: float) -> None:
        while True:
            await asyncio.sleep(idle_for / 4)
            try:
                await self.sessions.reap_idle(idle_for)
            except Exception:
                logger.exception("idle Session expiry failed; retried next round")

    # --- the app --------------------------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        app = FastAPI(
            title="agentic-lora gateway",
            docs_url=None,
            redoc_url=None,
            openapi_url=None,
        )

        async def on_typed_error(request: Request, exc: Exception) -> Response:
            return _error_response(exc)

        app.add_exception_handler(AgenticLoRAError, on_typed_error)

        for route in Route:
            app.add_api_route(
                route.value, self._generation_endpoint(route), methods=["POST"], name=route.name
            )
        app.add_api_route("/v1/models", self._models, methods=["GET"])
        app.add_api_route("/v1/sessions/{session_id}/close", self._close, methods=["POST"])
        app.add_api_route("/admin/publish", self._publish, methods=["POST"])
        app.add_api_route("/admin/status", self._status, methods=["GET"])
        app.add_api_route("/admin/reclaim", self._reclaim, methods=["POST"])
        app.add_api_route("/admin/resolve", self._resolve, methods=["POST"])
        app.add_api_route("/metrics", self._metrics, methods=["GET"])
        app.add_api_route("/health", self._health, methods=["GET"])
        app.add_api_route("/health/live", self._health, methods=["GET"])
        app.add_api_route("/health/ready", self._ready, methods=["GET"])
        return app

    # --- generation -----------------------------------------------------------------------------

    def _generation_endpoint(self, route: Route) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            return await self._generate(route, request)

        return endpoint

    async def _generate(self, route: Route, request: Request) -> Response:
        session: Session | None = None
        session_id: str | None = None
        try:
            session_id = session_id_from_headers(request.headers)
            body = await _json_object(request)
            session = await self.sessions.open(session_id)
            reply = await session.dispatch(route, body)
        except Exception as exc:
            return self._dispatch_failed(route, session_id, session, exc)
        finally:
            if session_id is not None and session is not None:
                self.sessions.touch(session_id)
        binding = session.binding
        assert binding is not None  # a versioned dispatch that returned was bound
        logger.info(
            "dispatch ok",
            extra={
                "session": session.key,
                "version": binding.version_id,
                "engine": reply.engine,
                "attempt": 1,
                "route": route.value,
            },
        )
        headers = {
            _VERSION_HEADER: binding.version_id,
            _LORA_HEADER: binding.lora_name,
            _ENGINE_HEADER: reply.engine,
            OUTCOME_HEADER: DispatchOutcome.OK.value,
        }
        body = reply.body
        turn = reply.provenance
        if turn is not None:
            headers[_DIGEST_HEADER] = turn.digest_prefix
            headers[_REVISION_AT_BIND_HEADER] = str(turn.default_revision_at_bind)
            if turn.lag is not None:
                headers[_LAG_HEADER] = str(turn.lag)
            if isinstance(body, Mapping):
                # A copy: the reply object stays exactly what the engine answered.
                body = {**body, PROVENANCE_FIELD: turn.to_dict()}
        return JSONResponse(body, status_code=reply.status_code, headers=headers)

    def _dispatch_failed(
        self, route: Route, session_id: str | None, session: Session | None, exc: Exception
    ) -> Response:
        # Past session.open the request may have reached an engine; an untyped failure there
        # is therefore indeterminate (typed errors say for themselves).
        outcome = classify_failure(exc, sent=session is not None)
        binding = session.binding if session is not None else None
        details = exc.details if isinstance(exc, AgenticLoRAError) else {}
        extra = {
            "session": session.key if session is not None else session_id,
            "version": binding.version_id if binding is not None else None,
            "engine": details.get("engine"),
            "attempt": 1,
            "route": route.value,
            "outcome": outcome.value,
            "code": exc.code if isinstance(exc, AgenticLoRAError) else type(exc).__name__,
        }
        if isinstance(exc, AgenticLoRAError):
            logger.warning("dispatch %s: %s", outcome.value, exc, extra=extra)
        else:
            logger.error("dispatch failed unexpectedly", exc_info=exc, extra=extra)
        return _error_response(exc, outcome=outcome)

    async def _models(self) -> Response:
        base = self.deployment.settings.base_model_name
        return JSONResponse(
            {
                "object": "list",
                "data": [{"id": base, "object": "model", "owned_by": "agentic-lora"}],
            }
        )

    async def _close(self, session_id: str, request: Request) -> Response:
        try:
            named: str | None = session_id_from_headers(request.headers)
        except AccessDeniedError:
            named = None
        if named is not None and named != session_id:
            raise InvalidRequestError(
                "the request names another Session in its headers than the one it closes",
                session=session_id,
            )
        result = await self.sessions.close(session_id)
        logger.info(
            "session close requested",
            extra={
                "session": session_id,
                "version": result.version_id if result is not None else None,
                "found": result is not None,
            },
        )
        return JSONResponse(
            {
                "session": session_id,
                "found": result is not None,
                "version_id": result.version_id if result is not None else None,
                "released_now": result.released_now if result is not None else False,
            }
        )

    # --- admin ----------------------------------------------------------------------------------

    def _require_admin(self, request: Request) -> None:
        if self._admin_token is None:
            raise AccessDeniedError(
                "the admin routes are disabled: start the gateway with an admin token",
                reason="admin_disabled",
            )
        scheme, _, token = (request.headers.get("authorization") or "").partition(" ")
        given = token.strip().encode()
        if scheme.lower() != "bearer" or not secrets.compare_digest(
            given, self._admin_token.encode()
        ):
            raise AccessDeniedError(
                "missing or wrong admin token (send `Authorization: Bearer <admin token>`)",
                reason="bad_admin_token",
            )

    async def _publish(self, request: Request) -> Response:
        self._require_admin(request)
        payload = await _json_object(request)
        adapter_dir = _string_field(payload, "adapter_dir")
        version_id = _string_field(payload, "version_id")
        if not Path(adapter_dir).is_absolute():
            raise InvalidRequestError(
                f"adapter_dir {adapter_dir!r} must be an absolute path on the gateway's host",
                field="adapter_dir",
            )
        if NDJSON in request.headers.get("accept", ""):
            return StreamingResponse(
                self._publication_stream(adapter_dir, version_id), media_type=NDJSON
            )
        task = self._spawn(self._publish_now(adapter_dir, version_id, None))
        # Shielded: a client that goes away must not cut a publication short.
        result = await asyncio.shield(task)
        return JSONResponse(publication_json(result))

    def _spawn(self, work: Awaitable[PublicationResult]) -> asyncio.Task[PublicationResult]:
        task = asyncio.ensure_future(work)
        self._background.add(task)

        def done(t: asyncio.Task[PublicationResult]) -> None:
            self._background.discard(t)
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
        async with self._publish_lock:
            unsubscribe = self.progress.subscribe(listener) if listener is not None else None
            try:
                snapshot = await asyncio.to_thread(AdapterSnapshot.from_peft_dir, adapter_dir)
                result = await self.deployment.publish(version_id, snapshot)
            except BaseException as exc:
                if self.metrics is not None and isinstance(exc, Exception):
                    self.metrics.observe_publication_error(exc)
                logger.warning(
                    "publication of %s failed: %s",
                    version_id,
                    exc,
                    extra={"version": version_id},
                )
                raise
            finally:
                if unsubscribe is not None:
                    unsubscribe()
        if self.metrics is not None:
            self.metrics.observe_publication(result)
        logger.info(
            "publication of %s: %s",
            version_id,
            result.outcome.value,
            extra={"version": version_id, "attempt": result.attempt},
        )
        return result

    async def _publication_stream(self, adapter_dir: str, version_id: str) -> AsyncIterator[bytes]:
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

    async def _status(self, request: Request) -> Response:
        self._require_admin(request)
        status = await self.deployment.status()
        return JSONResponse(
            {
                "registry": status_json(status),
                "fleet": [
                    {"engine": e.name, "base_url": e.base_url} for e in self.versioning.engines
                ],
                "gateway": {
                    "sessions": self.sessions.live(),
                    "adopted": self.sessions.adopted(),
                },
            }
        )

    async def _reclaim(self, request: Request) -> Response:
        self._require_admin(request)
        report = await self.deployment.reclaim()
        return JSONResponse(reclaim_report_json(report))

    async def _resolve(self, request: Request) -> Response:
        self._require_admin(request)
        # The body is optional: no body, `{}` or `{"version_id": null}` resolve everything.
        payload = await _json_object(request) if (await request.body()).strip() else {}
        version_id = (
            None if payload.get("version_id") is None else _string_field(payload, "version_id")
        )
        # Under the publication lock, so a streamed publication carries only its own events.
        async with self._publish_lock:
            report = await self.deployment.resolve(version_id)
        logger.info(
            "resolve requested",
            extra={
                "version": version_id,
                "resolved": list(report.resolved),
                "blocked": list(report.blocked),
            },
        )
        return JSONResponse(resolve_report_json(report))

    # --- monitoring -----------------------------------------------------------------------------

    async def _metrics(self) -> Response:
        if self.metrics is None:
            return _error_response(
                ConfigurationError("this gateway runs without metrics", check="metrics"),
                status=404,
            )
        status = await self.deployment.status()
        self.metrics.refresh(status, live_sessions=len(self.versioning.live_sessions()))
        return Response(self.metrics.exposition(), media_type=self.metrics.content_type)

    async def _ready(self) -> Response:
        # Readiness, not liveness: while the registry is fail-stopped or no engine answers, send
        # traffic elsewhere; /health/live stays 200 as long as the process answers at all.
        readiness = self.deployment.repairer.readiness()
        body: dict[str, Any] = {
            "status": "ready" if readiness.ready else "not_ready",
            "reasons": list(readiness.reasons),
            "engines": dict(readiness.engines),
        }
        if readiness.registry_error is not None:
            body["registry_error"] = readiness.registry_error
        return JSONResponse(body, status_code=200 if readiness.ready else 503)

    async def _health(self) -> Response:
        return JSONResponse({"status": "ok"})


def _line(payload: Mapping[str, Any]) -> bytes:
    return json.dumps(jsonable(payload), separators=(",", ":")).encode() + b"\n"
