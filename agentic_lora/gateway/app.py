"""The Session gateway: one Deployment behind an OpenAI-compatible HTTP API.

Routes (see ``docs/gateway.md`` for the full contract):

| route | who | what |
| --- | --- | --- |
| `POST /v1/chat/completions`, `POST /v1/completions`, `POST /generate` | agents | one generation in the caller's Session |
| `GET /v1/models` | agents | the served base model |
| `POST /v1/sessions/close` | agents, frameworks | end the caller's own Session: drain, release exactly once |
| `POST /v1/sessions/{id}/close` | frameworks, operators | the same for the Session ``id`` (its own credential or the admin token) |
| `POST /admin/publish`, `GET /admin/status`, `POST /admin/reclaim`, `POST /admin/resolve`, `POST /admin/rollback`, `GET`/`POST /admin/engines` | operators | behind the admin token |
| `GET /metrics` | monitoring | Prometheus text |
| `GET /health/live` (alias `GET /health`), `GET /health/ready` | monitoring | liveness; readiness |
| `GET /openapi.json` | tooling | the OpenAPI document (request models: :mod:`agentic_lora.gateway.schema`) |
| `GET /ui/` | operators | the status page (:mod:`agentic_lora.gateway.ui`), behind the admin token |

Every body is bounded and validated before any Session exists (:mod:`agentic_lora.gateway.limits`,
:mod:`agentic_lora.gateway.schema`); Session ids never reach a log (:mod:`agentic_lora.gateway.security`).

A generation is exactly one :meth:`~agentic_lora.session.Session.dispatch`: the gateway adds no
retry, and every failure answers with the error's stable code, an ``X-Agentic-Outcome`` of
``refused`` or ``indeterminate``, and ``x-should-retry: false`` unless resending is provably safe.
``"stream": true`` answers server-sent events, each chunk naming its version (see
:mod:`agentic_lora.gateway.streaming`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable
from collections.abc import Callable
from collections.abc import Collection
from collections.abc import Mapping
from typing import TYPE_CHECKING
from typing import Any
from typing import TypedDict
from typing import Unpack

from fastapi import FastAPI
from fastapi import Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from fastapi.responses import Response
from starlette.exceptions import HTTPException

from agentic_lora.assembly.deployment import Deployment
from agentic_lora.config import AgenticLoRASettings
from agentic_lora.errors import AccessDeniedError
from agentic_lora.errors import AgenticLoRAError
from agentic_lora.errors import ConfigurationError
from agentic_lora.errors import InvalidRequestError
from agentic_lora.foundation.auth import read_token
from agentic_lora.foundation.outcomes import DispatchOutcome
from agentic_lora.foundation.requests import Route
from agentic_lora.gateway.admin import AdminRoutes
from agentic_lora.gateway.fast_path import GenerationFastPath
from agentic_lora.gateway.generation import PROVENANCE_FIELD
from agentic_lora.gateway.generation import GenerationRoutes
from agentic_lora.gateway.generation import error_response
from agentic_lora.gateway.limits import GatewayLimits
from agentic_lora.gateway.progress import ProgressHub
from agentic_lora.gateway.schema import ErrorBody
from agentic_lora.gateway.schema import add_request_bodies
from agentic_lora.gateway.schema import request_models
from agentic_lora.gateway.security import SessionTagger
from agentic_lora.gateway.security import caller_of
from agentic_lora.gateway.security import check_session_id
from agentic_lora.gateway.security import install_access_log_redactor
from agentic_lora.gateway.session_header import SessionHeaders
from agentic_lora.gateway.sessions import GatewaySessions
from agentic_lora.gateway.streaming import SSE_MEDIA_TYPE
from agentic_lora.gateway.ui.routes import StatusPage
from agentic_lora.session import Session
from agentic_lora.session import Versioning

if TYPE_CHECKING:
    from agentic_lora.assembly.metrics import Metrics
    from agentic_lora.engines.backends import Backend

__all__ = ["PROVENANCE_FIELD", "Gateway", "GatewayOptions"]

logger = logging.getLogger(__name__)

#: Environment variable of the key that Session tags in logs are hashed with (optional).
SESSION_HASH_KEY_ENV = "AGENTIC_LORA_SESSION_HASH_KEY"
#: Error statuses a route may answer, documented in the OpenAPI document.
_ERROR_STATUSES = (400, 401, 404, 409, 410, 413, 429, 500, 502, 503)


def _tagger_for(admin_token: str | None) -> SessionTagger:
    key = read_token(env=SESSION_HASH_KEY_ENV, what="session hash key")
    if key is not None:
        return SessionTagger(key.encode())
    # Derived from the admin token, so tags (and key prefixes) stay the same across restarts.
    return SessionTagger.derived(admin_token) if admin_token else SessionTagger()


class GatewayOptions(TypedDict, total=False):
    """The gateway's own options, taken alike by :class:`Gateway` and
    :meth:`Gateway.from_settings` (described in :class:`Gateway`)."""

    admin_token: str | None
    idle_timeout: float | None
    reuse_closed_ids: bool
    clock: Callable[[], float]
    limits: GatewayLimits | None
    tagger: SessionTagger | None
    api_keys: Collection[str] | None


class Gateway(GenerationRoutes):
    """The HTTP face of one :class:`~agentic_lora.assembly.deployment.Deployment`.

    Build it with :meth:`from_settings` (it wires metrics and progress into the deployment),
    or around an existing deployment. ``app`` is the ASGI application: the generation routes on
    a plain-ASGI path (:mod:`.fast_path`), the rest by ``fastapi``, the FastAPI app that declares
    every route. Use ``async with gateway:`` (or :meth:`start` / :meth:`aclose`) around serving
    it: that runs the background reclaimer and the idle-Session expiry, and closes every Session
    at the end.

    * ``admin_token``: the bearer token of the ``/admin`` routes (None: they are disabled).
    * ``metrics``: instruments to serve on ``/metrics`` (their observers must already be hooked
      into the deployment, as :meth:`from_settings` does).
    * ``progress``: the hub the deployment reports progress to (its ``on_progress``); a streamed
      publication listens on it.
    * ``idle_timeout``: close Sessions unused this many seconds; None takes the settings'
      ``gateway_idle_timeout`` (default 900 s; 0 there turns expiry off).
    * ``reuse_closed_ids``: let a closed Session id open a new Session (default: refused).
    * ``limits``: input limits and the Session bound (default: from the settings).
    * ``tagger``: hashes Session ids for logs and registry keys (default: keyed by
      ``$AGENTIC_LORA_SESSION_HASH_KEY``, else derived from the admin token, else random).
    * ``clock``: measures Session idleness only (default: ``time.monotonic``).
    * ``api_keys``: keys that name Sessions by ``X-Session-ID`` (:mod:`.session_header`).

    ``admin_token``, ``idle_timeout``, ``reuse_closed_ids``, ``limits``, ``tagger`` and ``clock``
    are the :class:`GatewayOptions`.
    """

    def __init__(
        self,
        deployment: Deployment,
        *,
        metrics: Metrics | None = None,
        progress: ProgressHub | None = None,
        owns_deployment: bool = False,
        **options: Unpack[GatewayOptions],
    ) -> None:
        admin_token = options.get("admin_token")
        idle_timeout = options.get("idle_timeout")
        limits = options.get("limits")
        tagger = options.get("tagger")
        if idle_timeout is not None and idle_timeout <= 0:
            raise ConfigurationError("idle_timeout must be positive", check="idle_timeout")
        if admin_token is not None and not admin_token.strip():
            raise ConfigurationError("the admin token must not be empty", check="admin_token")
        settings = deployment.settings
        if idle_timeout is None and settings.gateway_idle_timeout > 0:
            idle_timeout = settings.gateway_idle_timeout
        self.deployment = deployment
        self.metrics = metrics
        self.progress = progress if progress is not None else ProgressHub()
        self.idle_timeout = idle_timeout
        self.limits = limits if limits is not None else GatewayLimits.from_settings(settings)
        self._models = request_models(self.limits)
        self._tagger = tagger if tagger is not None else _tagger_for(admin_token)
        # A full gateway frees places as the idle expiry closes Sessions: one round of it.
        retry_after = idle_timeout / 4 if idle_timeout is not None else 60.0
        # Session ids are durable names in the registry, held under the Versioning's owner lease
        # (from_settings makes it the gateway's: owner gateway_id, adopt on restart).
        self.sessions = GatewaySessions(
            deployment.versioning,
            lease=deployment.versioning.lease,
            clock=options.get("clock", time.monotonic),
            reuse_closed_ids=options.get("reuse_closed_ids", False),
            deployment_epoch=settings.deployment_epoch,
            tagger=self._tagger,
            max_sessions=self.limits.max_sessions,
            retry_after=max(1.0, min(retry_after, 60.0)),
        )
        self._admin_token = admin_token
        self._session_headers = SessionHeaders(options.get("api_keys"), admin_token)
        self.status_page = StatusPage(self, admin_token)
        self._admin = AdminRoutes(
            self, admin_token, on_published=self.status_page.operations.observe_publication
        )
        self._owns_deployment = owns_deployment
        self._reaper: asyncio.Task[None] | None = None
        install_access_log_redactor()
        self.fastapi = self._build_app()
        self.app = GenerationFastPath(self.fastapi, self._generate)

    @classmethod
    async def from_settings(
        cls,
        settings: AgenticLoRASettings,
        *,
        backend_options: Mapping[str, Any] | None = None,
        backend: Backend | None = None,
        with_metrics: bool = True,
        **options: Unpack[GatewayOptions],
    ) -> Gateway:
        """Registry, Sessions, publisher, reclaimer and backend from settings, instrumented.

        The deployment gets a :class:`ProgressHub` as its progress callback and, with
        ``with_metrics``, a dispatch-counting middleware, a registry listener and a metrics
        listener on the hub. The gateway owns the deployment (closed by :meth:`aclose`). Its
        Sessions bind under the owner lease of ``settings.gateway_id`` with
        ``on_restart="adopt"`` (see :mod:`agentic_lora.gateway.sessions`). ``options`` are the
        gateway's own (:class:`GatewayOptions`).
        """
        if not settings.enable_versioned_lora_publication:
            raise ConfigurationError(
                "the gateway serves versioned Sessions: enable --enable-versioned-lora-publication",
                check="flag",
            )
        metrics: Metrics | None = None
        progress = ProgressHub()
        if with_metrics:
            from agentic_lora.assembly.metrics import Metrics

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
        return cls(deployment, metrics=metrics, progress=progress, owns_deployment=True, **options)

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
        await self.learn_engine_limits()
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
        if self._admin.background:
            # A publication is never cut short: it would leave a version LOADING.
            await asyncio.wait(set(self._admin.background))
        if self._owns_deployment:
            await self.deployment.aclose()

    async def __aenter__(self) -> Gateway:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def learn_engine_limits(self) -> GatewayLimits:
        """Lower ``max_tokens`` to what the engines report they can hold, and return the limits.

        Read from each engine's server information (``context_length`` when the engine was
        started with one, and the token capacity ``max_total_num_tokens``): no request can
        generate more than either. An engine that does not answer leaves the limit unchanged;
        this is called by :meth:`start`, and may be called again after a fleet change.
        """
        transport: Any = self.versioning.transport
        reported: list[int] = []
        for engine in self.versioning.engines:
            try:
                info = await asyncio.wait_for(transport.server_info(engine.name), timeout=10)
            except Exception as exc:
                logger.info(
                    "engine limits not read; the configured max_tokens stays",
                    extra={"engine": engine.name, "error": type(exc).__name__},
                )
                continue
            if isinstance(info, Mapping):
                for key in ("context_length", "max_total_num_tokens"):
                    value = info.get(key)
                    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                        reported.append(value)
        limits = self.limits.with_context_length(min(reported) if reported else None)
        if limits != self.limits:
            logger.info(
                "max_tokens lowered to the engines' context",
                extra={"max_tokens": limits.max_tokens},
            )
            self.limits = limits
            self._models = request_models(limits)
        return self.limits

    async def _reap_forever(self, idle_for: float) -> None:
        while True:
            await asyncio.sleep(idle_for / 4)
            try:
                await self.sessions.reap_idle(idle_for)
            except AgenticLoRAError as exc:
                # A typed error's message may quote a Session id (a credential): the code only.
                logger.warning(
                    "idle Session expiry failed; retried next round", extra={"error": exc.code}
                )
            except Exception:
                logger.exception("idle Session expiry failed; retried next round")

    # --- the app --------------------------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        app = FastAPI(
            title="agentic-lora gateway",
            docs_url=None,
            redoc_url=None,
            openapi_url="/openapi.json",
        )

        async def on_typed_error(request: Request, exc: Exception) -> Response:
            return error_response(exc)

        async def on_routing_error(request: Request, exc: Exception) -> Response:
            # No route, or not this method: the same error shape as every other refusal, and
            # never the path in the message (the legacy close path holds a Session id).
            assert isinstance(exc, HTTPException)
            reason, message = {
                404: ("no_route", "no such route on this gateway (see /openapi.json)"),
                405: ("method_not_allowed", f"{request.method[:16]} is not allowed on this route"),
            }.get(exc.status_code, ("http", "refused by the HTTP layer"))
            refusal = InvalidRequestError(message, reason=reason)
            response = error_response(refusal, status=exc.status_code)
            response.headers.update(exc.headers or {})  # Allow, for a 405
            return response

        app.add_exception_handler(AgenticLoRAError, on_typed_error)
        app.add_exception_handler(HTTPException, on_routing_error)
        errors: dict[int | str, dict[str, Any]] = {
            status: {"model": ErrorBody, "description": "a typed error"}
            for status in _ERROR_STATUSES
        }
        anything: dict[int | str, dict[str, Any]] = {
            200: {"content": {"application/json": {"schema": {"type": "object"}}}}
        }

        # A generation with ``"stream": true`` answers server-sent events instead.
        streamed: dict[int | str, dict[str, Any]] = {
            200: {
                "content": {
                    "application/json": {"schema": {"type": "object"}},
                    SSE_MEDIA_TYPE: {
                        "schema": {
                            "type": "object",
                            "description": "one server-sent event: a chunk object, the final "
                            "error object, or [DONE]",
                        }
                    },
                }
            }
        }

        def add(
            path: str,
            endpoint: Callable[..., Awaitable[Response]],
            method: str,
            ok: dict[int | str, dict[str, Any]] = anything,
        ) -> None:
            app.add_api_route(path, endpoint, methods=[method], responses={**ok, **errors})

        for route in Route:
            add(route.value, self._generation_endpoint(route), "POST", streamed)
        add("/v1/models", self._list_models, "GET")
        add("/v1/sessions/close", self._close_own, "POST")
        add("/v1/sessions/{session_id}/close", self._close, "POST")
        for path, endpoint, method in self._admin.routes():
            add(path, endpoint, method)
        app.add_api_route("/metrics", self._metrics, methods=["GET"])
        add("/health", self._health, "GET")
        add("/health/live", self._health, "GET")
        add("/health/ready", self._ready, "GET")
        self.status_page.install(app)

        def openapi() -> dict[str, Any]:
            # Rebuilt on each call: the limits (and so the models) may change at start.
            document = get_openapi(title=app.title, version="1", routes=app.routes)
            return add_request_bodies(document, self._models)

        app.openapi = openapi  # type: ignore[method-assign]
        return app

    async def _list_models(self) -> Response:
        base = self.deployment.settings.base_model_name
        model = {"id": base, "object": "model", "owned_by": "agentic-lora"}
        return JSONResponse({"object": "list", "data": [model]})

    async def _close_own(self, request: Request) -> Response:
        """``POST /v1/sessions/close``: the caller's own Session, named by its credential (so
        no Session id is in the path, and none in the access log). The admin token closes the
        Session named in ``X-Agentic-Session``; an API key the one in ``X-Session-ID``."""
        named = self._session_headers.named(request.headers, missing="name the Session to close")
        return await self._close_now(named.session_id, named.shown)

    async def _close(self, session_id: str, request: Request) -> Response:
        """``POST /v1/sessions/{id}/close``: only with that Session's credential or the admin
        token; with an API key, ``id`` is an ``X-Session-ID`` of that key."""
        if (named := self._session_headers.for_close(session_id, request.headers)) is not None:
            return await self._close_now(named.session_id, named.shown)
        check_session_id(session_id, "the path")
        caller = caller_of(request.headers, self._admin_token)
        if not caller.admin and caller.session_id != session_id:
            # The id in the path alone proves nothing: ids are guessable (episode-17).
            raise AccessDeniedError(
                "closing a Session takes its own credential (`Authorization: Bearer <session "
                "id>`) or the admin token",
                reason="not_owner",
            )
        return await self._close_now(session_id)

    async def _close_now(self, session_id: str, shown: str | None = None) -> Response:
        result = await self.sessions.close(session_id)
        logger.info(
            "session close requested",
            extra={
                "session": self._tagger.tag(session_id),
                "version": result.version_id if result is not None else None,
                "found": result is not None,
            },
        )
        return JSONResponse(
            {
                "session": shown if shown is not None else session_id,
                "found": result is not None,
                "version_id": result.version_id if result is not None else None,
                "released_now": result.released_now if result is not None else False,
            }
        )

    def _log_failure(
        self, route: Route, session_id: str | None, session: Session | None, exc: BaseException
    ) -> DispatchOutcome:
        outcome = super()._log_failure(route, session_id, session, exc)
        self.status_page.refusals.record(exc, outcome, route.value)
        if self.metrics is not None:
            self.metrics.observe_failed_request(exc)
        return outcome

    # --- monitoring -----------------------------------------------------------------------------

    async def _metrics(self) -> Response:
        if self.metrics is None:
            return error_response(
                ConfigurationError("this gateway runs without metrics", check="metrics"),
                status=404,
            )
        status = await self.deployment.status()
        self.metrics.refresh(
            status,
            live_sessions=len(self.versioning.live_sessions()),
            engine_health=self.deployment.repairer.readiness().engines,
        )
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
