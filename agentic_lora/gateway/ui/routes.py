"""The status page's HTTP routes, mounted on the gateway under ``/ui/``.

| route | auth | what |
| --- | --- | --- |
| `GET /ui/` (`/ui` redirects) | none | the page: static HTML, no data |
| `GET /ui/static/{app.js,app.css,favicon.svg}` | none | its script, style and icon (shipped in the package) |
| `POST /ui/login` | the admin token, in a JSON body | a page session cookie (see :mod:`~agentic_lora.gateway.ui.auth`) |
| `POST /ui/logout` | the cookie | ends the page session |
| `GET /ui/api/view` | the cookie or `Authorization: Bearer <admin token>` | the page's data (:mod:`~agentic_lora.gateway.ui.view`), paged by the :class:`~agentic_lora.gateway.ui.view.ViewQuery` parameters |

The page polls ``/ui/api/view`` about once a second; each answer carries an ``ETag`` and an
unchanged view answers ``304`` with no body. Views are built at most once per
``min_rebuild`` seconds per query, however many browsers poll. Every page answer carries a
strict Content-Security-Policy (scripts and styles from the page's own origin only, nothing
inline, no frames); the page loads nothing from anywhere else.

Cross-site requests cannot log in or out: both routes take only ``application/json`` (a
cross-site form cannot send it without a preflight the gateway never grants) and refuse a
request whose ``Origin`` or ``Sec-Fetch-Site`` says it came from another site; the cookie is
``SameSite=Strict``. The page itself changes nothing: it only reads.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from importlib import resources
from typing import TYPE_CHECKING
from typing import Any
from urllib.parse import urlsplit

from fastapi import FastAPI
from fastapi import Request
from fastapi.responses import RedirectResponse
from fastapi.responses import Response

from agentic_lora.errors import AccessDeniedError
from agentic_lora.errors import InvalidRequestError
from agentic_lora.foundation.auth import bearer_matches
from agentic_lora.gateway.generation import error_response
from agentic_lora.gateway.limits import parse_json
from agentic_lora.gateway.limits import read_body
from agentic_lora.gateway.ui.activity import OperationLog
from agentic_lora.gateway.ui.activity import RefusalLog
from agentic_lora.gateway.ui.auth import UILogins
from agentic_lora.gateway.ui.view import GatewayFacts
from agentic_lora.gateway.ui.view import LagHistogram
from agentic_lora.gateway.ui.view import ViewQuery
from agentic_lora.gateway.ui.view import build_view
from agentic_lora.gateway.ui.view import lag_histogram

if TYPE_CHECKING:
    from agentic_lora.gateway.admin import AdminHost

__all__ = ["CONTENT_SECURITY_POLICY", "COOKIE_NAME", "StatusPage"]

logger = logging.getLogger(__name__)

#: The page session cookie.
COOKIE_NAME = "agentic_lora_ui"
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
_SECURITY_HEADERS = {
    "content-security-policy": CONTENT_SECURITY_POLICY,
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "no-referrer",
    "cross-origin-opener-policy": "same-origin",
    "cross-origin-resource-policy": "same-origin",
}
_STATIC = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "app.css": "text/css; charset=utf-8",
    "favicon.svg": "image/svg+xml",
}
#: A login body holds one token: anything longer is refused unread.
_MAX_LOGIN_BODY = 8192
#: Distinct queries whose last view is kept for reuse.
_CACHED_QUERIES = 16


def _asset(name: str) -> bytes:
    return (resources.files(__package__ or "") / "static" / name).read_bytes()


def _strong_etag(body: bytes) -> str:
    return '"' + hashlib.sha256(body).hexdigest()[:32] + '"'


class StatusPage:
    """The status page of one :class:`~agentic_lora.gateway.app.Gateway` (what the admin
    routes act on, :class:`~agentic_lora.gateway.admin.AdminHost`): its records of recent
    operations and refusals, its logins, and its routes (:meth:`install`).

    ``min_rebuild``: seconds a built view is reused for the same query. ``clock`` is the wall
    clock of timestamps and lease deadlines; ``monotonic`` times the reuse.
    """

    def __init__(
        self,
        gateway: AdminHost,
        admin_token: str | None,
        *,
        logins: UILogins | None = None,
        min_rebuild: float = 0.5,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._gateway = gateway
        self._token = admin_token
        self.logins = logins if logins is not None else UILogins(admin_token)
        self.operations = OperationLog(clock=clock)
        self.refusals = RefusalLog(clock=clock)
        self._clock = clock
        self._monotonic = monotonic
        self._min_rebuild = min_rebuild
        self._built: OrderedDict[ViewQuery, tuple[float, bytes, str]] = OrderedDict()
        self._assets = {name: _asset(name) for name in _STATIC}
        gateway.progress.subscribe(self.operations)

    # --- the data -------------------------------------------------------------------------------

    async def view(self, query: ViewQuery | None = None) -> dict[str, Any]:
        """The page's data now (reads the registry status once)."""
        gateway = self._gateway
        status = await gateway.deployment.status()
        readiness = gateway.deployment.repairer.readiness()
        facts = GatewayFacts(
            sessions=gateway.sessions.live(),
            adopted=gateway.sessions.adopted(),
            engine_health=readiness.engines,
            ready=readiness.ready,
            reasons=readiness.reasons,
        )
        return build_view(
            status,
            facts,
            operations=self.operations.recent(),
            refusals=self.refusals,
            dispatch_lag=self._dispatch_lag(),
            query=query,
            now=self._clock(),
        )

    def _dispatch_lag(self) -> LagHistogram | None:
        metrics = self._gateway.metrics
        if metrics is None:
            return None
        samples = (
            (s.name, s.labels, s.value)
            for family in metrics.session_version_lag.collect()
            for s in family.samples
        )
        return lag_histogram(samples)

    async def _encoded(self, query: ViewQuery) -> tuple[bytes, str]:
        now = self._monotonic()
        cached = self._built.get(query)
        if cached is not None and now - cached[0] < self._min_rebuild:
            return cached[1], cached[2]
        view = await self.view(query)
        body = json.dumps(view, separators=(",", ":")).encode()
        # The tag leaves out the time of the read: an unchanged fleet answers 304.
        etag = _strong_etag(json.dumps({**view, "at": None}, separators=(",", ":")).encode())
        self._built[query] = (now, body, etag)
        self._built.move_to_end(query)
        while len(self._built) > _CACHED_QUERIES:
            self._built.popitem(last=False)
        return body, etag

    # --- routes ---------------------------------------------------------------------------------

    def install(self, app: FastAPI) -> None:
        """Add the routes of the module docstring to ``app``."""
        hidden: dict[str, Any] = {"include_in_schema": False}
        app.add_api_route("/ui", self._to_page, methods=["GET"], **hidden)
        app.add_api_route("/ui/", self._page, methods=["GET"], **hidden)
        app.add_api_route("/ui/static/{name}", self._static, methods=["GET"], **hidden)
        app.add_api_route("/ui/login", self._login, methods=["POST"], **hidden)
        app.add_api_route("/ui/logout", self._logout, methods=["POST"], **hidden)
        app.add_api_route("/ui/api/view", self._view, methods=["GET"], **hidden)

    async def _to_page(self, request: Request) -> Response:
        return RedirectResponse(request.url.path + "/", status_code=308)

    async def _page(self) -> Response:
        return self._answer(self._assets["index.html"], _STATIC["index.html"], cache="no-cache")

    async def _static(self, name: str) -> Response:
        if name == "index.html" or name not in self._assets:
            return error_response(
                InvalidRequestError("no such file on this page", reason="no_route"), status=404
            )
        return self._answer(self._assets[name], _STATIC[name], cache="no-cache")

    def _answer(
        self, body: bytes, media_type: str, *, cache: str, etag: str | None = None
    ) -> Response:
        headers = {**_SECURITY_HEADERS, "cache-control": cache}
        if etag is not None:
            headers["etag"] = etag
        return Response(body, media_type=media_type, headers=headers)

    def _signed_in(self, request: Request) -> bool:
        if self.logins.valid(request.cookies.get(COOKIE_NAME)):
            return True
        return self._token is not None and bearer_matches(
            request.headers.get("authorization"), self._token
        )

    async def _view(self, request: Request) -> Response:
        if not self._signed_in(request):
            reason = "admin_disabled" if not self.logins.enabled else "not_logged_in"
            return self._refused(AccessDeniedError("log in to the status page", reason=reason))
        query = ViewQuery.from_params(request.query_params)
        body, etag = await self._encoded(query)
        if etag in request.headers.get("if-none-match", ""):
            return Response(status_code=304, headers={"etag": etag, "cache-control": "no-store"})
        return self._answer(body, "application/json", cache="no-store", etag=etag)

    async def _login(self, request: Request) -> Response:
        self._same_origin_json(request)
        raw = await read_body(
            request.headers, request.stream(), _MAX_LOGIN_BODY, route=request.url.path
        )
        body = parse_json(raw, max_depth=2, route=request.url.path)
        token = body.get("token") if isinstance(body, dict) else None
        if not isinstance(token, str):
            raise InvalidRequestError('the body must be {"token": "<admin token>"}', field="token")
        try:
            grant = self.logins.login(token)
        except AccessDeniedError as exc:
            logger.warning("status page login refused", extra={"reason": exc.details["reason"]})
            return self._refused(exc)
        logger.info("status page login")
        response = self._answer(
            json.dumps({"expires_in": grant.max_age}).encode(), "application/json", cache="no-store"
        )
        response.set_cookie(
            COOKIE_NAME,
            grant.value,
            max_age=grant.max_age,
            path=self._cookie_path(request),
            secure=request.url.scheme == "https",
            httponly=True,
            samesite="strict",
        )
        return response

    async def _logout(self, request: Request) -> Response:
        self._same_origin_json(request)
        ended = self.logins.logout(request.cookies.get(COOKIE_NAME))
        response = self._answer(
            json.dumps({"logged_out": ended}).encode(), "application/json", cache="no-store"
        )
        response.delete_cookie(
            COOKIE_NAME,
            path=self._cookie_path(request),
            secure=request.url.scheme == "https",
            httponly=True,
            samesite="strict",
        )
        return response

    @staticmethod
    def _cookie_path(request: Request) -> str:
        root = str(request.scope.get("root_path", ""))
        return root.rstrip("/") + "/ui/"

    @staticmethod
    def _same_origin_json(request: Request) -> None:
        """Refuse what a page of another site could make a browser send (see module docstring)."""
        media = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if media != "application/json":
            raise InvalidRequestError("send the body as application/json", reason="not_json")
        # Every current browser says where a request came from in Sec-Fetch-Site; an older one
        # sends Origin, whose host must be this one (only the host: a TLS-terminating proxy in
        # front changes the scheme the gateway sees).
        site = request.headers.get("sec-fetch-site")
        origin = request.headers.get("origin")
        if site is not None:
            cross = site not in ("same-origin", "none")
        else:
            cross = origin is not None and urlsplit(origin).netloc != request.headers.get("host")
        if cross:
            raise AccessDeniedError("a cross-site request is refused", reason="cross_site")

    def _refused(self, exc: AccessDeniedError) -> Response:
        reason = exc.details.get("reason")
        if reason == "too_many_attempts":
            response = error_response(exc, status=429)
            response.headers["retry-after"] = str(max(1, round(self.logins.retry_after() + 0.5)))
        else:
            response = error_response(exc)
        response.headers.update(_SECURITY_HEADERS)
        response.headers["cache-control"] = "no-store"
        return response
