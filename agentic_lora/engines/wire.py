"""One vocabulary for "may the engine have acted on this request?", and one translation table.

Every HTTP call this project makes to an engine (a generation, an abort, a server-info read, a
LoRA load or unload) ends in one of three ways: an answer, or a failure that is either

* :attr:`Outcome.REFUSED`: the engine provably did not accept the request (nothing left this
  process, or the engine answered 4xx), so the caller may decide to send it again; or
* :attr:`Outcome.INDETERMINATE`: it may have (a timeout or reset after the request went out, a
  5xx, an answer that does not parse), so sending it again may run it twice.

:func:`classify_exception` (transport failures, through :data:`EXCEPTION_TABLE`, which lists every
failure type of httpx and of aiohttp) and :func:`classify_status` (answers) are the only places
that decide which, and :data:`WIRE_ERRORS` is what a client catches to hand a failure to them.
The generation transport (:mod:`agentic_lora.engines.transport`, errors
``REQUEST_REFUSED``/``REQUEST_INDETERMINATE``) and the admin clients
(:mod:`agentic_lora.engines.admin`, errors ``BACKEND_REFUSED``/``BACKEND_AMBIGUOUS``) both translate
through them. The admin clients build their ``httpx.AsyncClient`` with :func:`make_engine_client`,
the transport its HTTP stack with :func:`agentic_lora.engines.stack_choice.make_stack` (aiohttp directly,
or httpx); on every one: no retries, no environment proxy, no redirects (one request is one
attempt on the wire).

:class:`EngineHttp` is the one thing an engine dialect (:mod:`agentic_lora.engines.dialect`) reads
an engine through, so a dialect's readers (server info, incarnation) are written once and serve
both clients.
"""

from __future__ import annotations

import enum
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any
from typing import Literal
from typing import Protocol
from typing import runtime_checkable

import httpx

__all__ = [
    "EXCEPTION_TABLE",
    "NOT_SENT",
    "WIRE_ERRORS",
    "EngineHttp",
    "HttpAnswer",
    "HttpTransportKind",
    "Outcome",
    "ReplyTooDeepError",
    "classify_exception",
    "classify_status",
    "decode_body",
    "decode_content",
    "error_detail",
    "make_engine_client",
]

logger = logging.getLogger(__name__)

HttpTransportKind = Literal["aiohttp", "httpx"]


class Outcome(enum.StrEnum):
    """The answer to "may the engine have accepted this request?"."""

    REFUSED = "refused"  # provably not accepted
    INDETERMINATE = "indeterminate"  # may have been accepted


#: The one exception table: for each failure type of the two HTTP libraries (httpx, and aiohttp,
#: used directly by the transport's default stack and under ``httpx_aiohttp``), whether the engine may have accepted the request. The entry of the
#: nearest class in an exception's MRO decides; a type in neither tree is indeterminate (what
#: cannot be proven unsent may have run). Every type either stack can raise has its own entry, so
#: a new subclass in either library lands on its base's verdict, never on an unhandled 5xx.
EXCEPTION_TABLE: Mapping[type[BaseException], Outcome]

#: httpx errors raised before a single byte of the request left this process.
NOT_SENT: tuple[type[Exception], ...] = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.PoolTimeout,
    httpx.UnsupportedProtocol,
    # httpx raises it only when a proxy refuses the tunnel (or the SOCKS handshake): the
    # request never reached the engine. No proxy is configured (trust_env=False); kept for
    # clients built around one.
    httpx.ProxyError,
    # A URL httpx cannot build a request for (raised by ``build_request``, so before sending).
    httpx.InvalidURL,
)

_HTTPX_MAY_HAVE_RUN: tuple[type[Exception], ...] = (
    httpx.HTTPError,  # any other: the catch-all, so an unlisted subclass stays indeterminate
    httpx.RequestError,
    httpx.TransportError,
    httpx.TimeoutException,
    httpx.ReadTimeout,
    httpx.WriteTimeout,  # part of the body may already be with the engine
    httpx.NetworkError,
    httpx.ReadError,
    httpx.WriteError,
    httpx.CloseError,
    httpx.ProtocolError,
    httpx.LocalProtocolError,
    httpx.RemoteProtocolError,
    # The engine answered (so it had the request) with a content-encoding that cannot be
    # decoded: whatever it did is unknown. A 4xx status, when known, still proves refusal.
    httpx.DecodingError,
    # Redirects are never followed (one request is one attempt), but a redirect is an answer.
    httpx.TooManyRedirects,
)

# aiohttp classes by name, as some exist only in newer releases (a missing one is skipped).
_AIOHTTP_NOT_SENT = (
    # Failed to open the connection: DNS, refused, TLS handshake, certificate, proxy connect.
    "ClientConnectorError",
    "ClientConnectorDNSError",
    "ClientProxyConnectionError",
    "UnixClientConnectorError",
    "ClientSSLError",
    "ClientConnectorSSLError",
    "ClientConnectorCertificateError",
    "ConnectionTimeoutError",
    # The TLS peer is not the pinned one: checked by the connector before a byte is written.
    "ServerFingerprintMismatch",
    # A proxy refused the tunnel: the request never reached the engine.
    "ClientHttpProxyError",
    # A URL aiohttp will not request at all: raised before connecting.
    "InvalidURL",
    "InvalidUrlClientError",
    "NonHttpUrlClientError",
)
_AIOHTTP_MAY_HAVE_RUN = (
    "ClientError",  # the catch-all: an unlisted subclass stays indeterminate
    # A live connection failed (reset while writing or reading, dropped, timed out reading).
    "ClientConnectionError",
    "ClientConnectionResetError",
    "ClientOSError",
    "ServerConnectionError",
    "ServerDisconnectedError",
    "ServerTimeoutError",
    "SocketTimeoutError",
    # The request body upload stopped part way: the engine may have the request.
    "UploadAbortedError",
    # The engine answered, so it had the request: a broken body, a malformed status line or
    # headers, an unexpected content type, a failed upgrade.
    "ClientPayloadError",
    "ClientResponseError",
    "ContentTypeError",
    "WSServerHandshakeError",
    # A redirect is an answer (redirects are never followed, but say so if one is).
    "TooManyRedirects",
    "RedirectClientError",
    "InvalidUrlRedirectClientError",
    "NonHttpUrlRedirectClientError",
)


def _aiohttp_table() -> tuple[type[BaseException] | None, dict[type[BaseException], Outcome]]:
    try:
        import aiohttp
        from aiohttp import client_exceptions
    except ImportError:  # pragma: no cover - aiohttp ships with httpx-aiohttp, a core dependency
        return None, {}
    table: dict[type[BaseException], Outcome] = {}
    for names, outcome in (
        (_AIOHTTP_MAY_HAVE_RUN, Outcome.INDETERMINATE),
        (_AIOHTTP_NOT_SENT, Outcome.REFUSED),
    ):
        for name in names:
            cls = getattr(client_exceptions, name, None)
            if isinstance(cls, type) and issubclass(cls, BaseException):
                table[cls] = outcome
    return aiohttp.ClientError, table


def _build_table() -> tuple[type[BaseException] | None, Mapping[type[BaseException], Outcome]]:
    aiohttp_base, table = _aiohttp_table()
    table.update(dict.fromkeys(_HTTPX_MAY_HAVE_RUN, Outcome.INDETERMINATE))
    table.update(dict.fromkeys(NOT_SENT, Outcome.REFUSED))
    return aiohttp_base, MappingProxyType(table)


_AIOHTTP_ERROR, EXCEPTION_TABLE = _build_table()

#: What a call to an engine may raise for what happened on the wire (everything
#: :data:`EXCEPTION_TABLE` classifies): httpx's request errors, an invalid URL, and aiohttp's
#: errors (raised by the aiohttp stack, or passed through unmapped by ``httpx_aiohttp``).
WIRE_ERRORS: tuple[type[BaseException], ...] = (httpx.RequestError, httpx.InvalidURL) + (
    () if _AIOHTTP_ERROR is None else (_AIOHTTP_ERROR,)
)


def _table_outcome(exc: BaseException) -> Outcome:
    for cls in type(exc).__mro__:
        outcome = EXCEPTION_TABLE.get(cls)
        if outcome is not None:
            return outcome
    return Outcome.INDETERMINATE


def classify_exception(exc: BaseException) -> Outcome:
    """Classify a failed HTTP exchange by whether the request can have reached the engine.

    httpx-aiohttp maps every ``aiohttp.ClientConnectionError`` to ``httpx.ConnectTimeout``, even a
    server disconnect after the request was written; the httpx type alone would call that
    "refused". So when an aiohttp error is in the cause chain, its entry in
    :data:`EXCEPTION_TABLE` decides; otherwise the entry of ``exc`` itself does.
    """
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if _AIOHTTP_ERROR is not None and isinstance(cause, _AIOHTTP_ERROR):
            return _table_outcome(cause)
        cause = cause.__cause__
    return _table_outcome(exc)


def classify_status(status_code: int) -> Outcome | None:
    """None for a 2xx answer; 4xx: refused (the engine rejected it); anything else: indeterminate."""
    if 200 <= status_code < 300:
        return None
    if 400 <= status_code < 500:
        return Outcome.REFUSED
    return Outcome.INDETERMINATE


def decode_body(response: httpx.Response) -> Any:
    """:func:`decode_content` of an httpx answer that was read."""
    return decode_content(response.status_code, response.content, response.encoding or "utf-8")


def decode_content(status: int, content: bytes, charset: str) -> Any:
    """The decoded JSON body, else its text (in ``charset``), else None for an empty body.

    Raises :class:`ReplyTooDeepError` for a JSON body nested deeper than this process can
    decode: kept as text it would reach the caller as a different value, so the caller
    classifies it as a failed answer instead.
    """
    if not content:
        return None
    try:
        try:
            # UTF-8 first, as every engine answers: ``json.loads`` of bytes would first guess
            # the encoding on every reply. Anything this does not parse (another encoding, a
            # BOM, not JSON) takes the bytes path below, so the result is ``json.loads``'s.
            return json.loads(content.decode())
        except ValueError:
            return json.loads(content)
    except RecursionError as exc:
        raise ReplyTooDeepError(status) from exc
    except ValueError:
        try:
            return content.decode(charset, errors="replace")
        except LookupError:  # a charset Python does not know: as httpx does, UTF-8
            return content.decode("utf-8", errors="replace")


class ReplyTooDeepError(ValueError):
    """An engine answered JSON nested deeper than this process can decode (see
    :func:`decode_body`). ``status`` is the answer's HTTP status."""

    def __init__(self, status: int) -> None:
        super().__init__(f"the HTTP {status} answer nests deeper than this process can decode")
        self.status = status


@dataclass(frozen=True, slots=True)
class HttpAnswer:
    """An engine's HTTP answer, whatever its status: ``body`` decoded (see :func:`decode_body`)."""

    status: int
    body: Any
    text: str


@runtime_checkable
class EngineHttp(Protocol):
    """One engine, as a dialect reads it.

    ``get_answer`` returns every HTTP answer (4xx included) and raises only for what happened on
    the wire, already classified in the client's own error family. ``failure`` builds that
    family's error for an answer the dialect judged (refused: ``*_REFUSED``; indeterminate:
    ``REQUEST_INDETERMINATE`` or ``BACKEND_AMBIGUOUS``).
    """

    @property
    def engine(self) -> str:
        """The engine's name (or base URL), for messages."""
        ...

    async def get_answer(self, op: str, path: str) -> HttpAnswer:
        """``GET path``: the answer, or a classified transport failure."""
        ...

    def failure(self, outcome: Outcome, op: str, message: str, **details: Any) -> Exception:
        """The client's typed error for a judged answer."""
        ...


def make_engine_client(
    kind: HttpTransportKind, timeout: httpx.Timeout, limits: httpx.Limits
) -> tuple[httpx.AsyncClient, HttpTransportKind]:
    """An engine client with no retries, no proxy and no redirects, and the transport it runs on.

    ``"aiohttp"`` (``httpx_aiohttp.AiohttpTransport``, several times the throughput of httpx's
    own on loopback) falls back to ``"httpx"`` when that package is missing.
    """
    transport: httpx.AsyncBaseTransport
    if kind == "aiohttp":
        try:
            from httpx_aiohttp import AiohttpTransport
        except ImportError:
            logger.warning("httpx-aiohttp is not installed; using httpx's default transport")
            kind = "httpx"
        else:
            transport = AiohttpTransport(retries=0, limits=limits, trust_env=False)
    if kind == "httpx":
        transport = httpx.AsyncHTTPTransport(retries=0, limits=limits, trust_env=False)
    # trust_env=False: an environment proxy would be another hop that may retry (or log
    # credentials) between this process and the engine.
    client = httpx.AsyncClient(
        transport=transport, timeout=timeout, follow_redirects=False, trust_env=False
    )
    return client, kind


def error_detail(body: Any) -> str:
    """The message of an engine's error body (SGLang and OpenAI shapes), or "no detail"."""
    if isinstance(body, Mapping):
        error = body.get("error")
        if isinstance(error, Mapping) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str):
            return error
        for key in ("error_message", "message", "detail"):
            if body.get(key):
                return str(body[key])
    return "no detail"
