"""One vocabulary for "may the engine have acted on this request?", and one translation table.

Every HTTP call this project makes to an engine (a generation, an abort, a server-info read, a
LoRA load or unload) ends in one of three ways: an answer, or a failure that is either

* :attr:`Outcome.REFUSED`: the engine provably did not accept the request (nothing left this
  process, or the engine answered 4xx), so the caller may decide to send it again; or
* :attr:`Outcome.INDETERMINATE`: it may have (a timeout or reset after the request went out, a
  5xx, an answer that does not parse), so sending it again may run it twice.

:func:`classify_exception` (transport failures) and :func:`classify_status` (answers) are the only
places that decide which; the generation transport (:mod:`agentic_lora.transport`, errors
``REQUEST_REFUSED``/``REQUEST_INDETERMINATE``) and the admin clients
(:mod:`agentic_lora.engine_admin`, errors ``BACKEND_REFUSED``/``BACKEND_AMBIGUOUS``) both translate
through them, and both build their ``httpx.AsyncClient`` with :func:`make_engine_client` (no
retries, no environment proxy, no redirects: one request is one attempt on the wire).

:class:`EngineHttp` is the one thing an engine dialect (:mod:`agentic_lora.engines.dialect`) reads
an engine through, so a dialect's readers (server info, incarnation) are written once and serve
both clients.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import httpx

__all__ = [
    "NOT_SENT",
    "EngineHttp",
    "HttpAnswer",
    "HttpTransportKind",
    "Outcome",
    "classify_exception",
    "classify_status",
    "decode_body",
    "make_engine_client",
]

logger = logging.getLogger(__name__)

HttpTransportKind = Literal["aiohttp", "httpx"]


class Outcome(enum.StrEnum):
    """The answer to "may the engine have accepted this request?"."""

    REFUSED = "refused"  # provably not accepted
    INDETERMINATE = "indeterminate"  # may have been accepted


#: httpx errors raised before a single byte of the request left this process.
NOT_SENT: tuple[type[Exception], ...] = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.PoolTimeout,
    httpx.UnsupportedProtocol,
)


def _aiohttp_errors() -> tuple[type[BaseException], tuple[type[BaseException], ...]] | None:
    try:
        import aiohttp
    except ImportError:  # pragma: no cover - aiohttp ships with httpx-aiohttp, a core dependency
        return None
    return aiohttp.ClientError, (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)


def classify_exception(exc: BaseException) -> Outcome:
    """Classify a failed HTTP exchange by whether the request can have reached the engine.

    httpx-aiohttp maps every ``aiohttp.ClientConnectionError`` to ``httpx.ConnectTimeout``, even a
    server disconnect after the request was written; the httpx type alone would call that
    "refused". So when an aiohttp error is in the cause chain it decides: only a failure to
    connect (``ClientConnectorError``, ``ConnectionTimeoutError``) proves nothing was sent.
    """
    aio = _aiohttp_errors()
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if aio is not None and isinstance(cause, aio[0]):
            return Outcome.REFUSED if isinstance(cause, aio[1]) else Outcome.INDETERMINATE
        cause = cause.__cause__
    if isinstance(exc, NOT_SENT):
        return Outcome.REFUSED
    return Outcome.INDETERMINATE


def classify_status(status_code: int) -> Outcome | None:
    """None for a 2xx answer; 4xx: refused (the engine rejected it); anything else: indeterminate."""
    if 200 <= status_code < 300:
        return None
    if 400 <= status_code < 500:
        return Outcome.REFUSED
    return Outcome.INDETERMINATE


def decode_body(response: httpx.Response) -> Any:
    """The decoded JSON body, else its text, else None for an empty body."""
    if not response.content:
        return None
    try:
        return response.json()
    except ValueError:
        return response.text


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
