"""The HTTP stacks under the engine transport: bytes out, one answer back, nothing decided.

:class:`~agentic_lora.engines.transport.EngineTransport` decides what a failure means; a stack only
carries one request and hands back its answer. Two stacks fit the seam, chosen by the
``http_transport`` setting:

* ``"aiohttp"`` (the default): an ``aiohttp.ClientSession`` used directly
  (:mod:`agentic_lora.engines.aiohttp_stack`). httpx's client on top of aiohttp cost more client CPU
  per request than everything versioning adds to a request (``bench/dispatch.py``), so the hot path
  no longer pays for it.
* ``"httpx"``: an ``httpx.AsyncClient`` on httpx's own transport, which respx mocks; also the
  fallback where aiohttp is not installed.

This module is the seam (:class:`HttpStack`, :class:`StackAnswer`) and the httpx stack;
:func:`~agentic_lora.engines.stack_choice.make_stack` picks one, so neither stack's module
needs the other's.

Both send what they are given once: no retries, no redirects, no environment proxy. A stack raises
only what :data:`~agentic_lora.engines.wire.WIRE_ERRORS` covers, and
:func:`~agentic_lora.engines.wire.classify_exception` knows every failure type of both.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from collections.abc import Awaitable
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol
from typing import TypeVar

import httpx

from agentic_lora.engines.wire import HttpTransportKind
from agentic_lora.engines.wire import make_engine_client

__all__ = ["HttpStack", "HttpxStack", "StackAnswer", "cached_url"]

#: URLs are parsed once per (engine, route); a fleet has a few of each, bounded regardless.
MAX_CACHED_URLS = 256

U = TypeVar("U")


def cached_url(
    cache: dict[tuple[str, str], U], base_url: str, path: str, parse: Callable[[str], U]
) -> U:
    """``parse(base_url + path)``, parsed once per (base URL, path) while the cache has room."""
    url = cache.get((base_url, path))
    if url is None:
        url = parse(base_url.rstrip("/") + path)
        if len(cache) < MAX_CACHED_URLS:
            cache[(base_url, path)] = url
    return url


@dataclass(frozen=True, slots=True)
class StackAnswer:
    """One answer whose head is in: its status, and how to read, stream and close its body.

    ``read`` reading the whole body releases the answer (its connection goes back to the pool),
    so a caller closes only an answer it did not read in full. ``close`` releases the answer. One
    not read to its end closes its connection: that is how an engine without abort by id learns
    that nobody reads the request any more.
    """

    status: int
    #: How to decode the body as text (the answer's charset, else UTF-8).
    charset: str
    #: The whole body; the answer is released once it is read.
    read: Callable[[], Awaitable[bytes]]
    #: The body, one decoded line at a time (line ends stripped).
    lines: Callable[[], AsyncIterator[str]]
    close: Callable[[], Awaitable[None]]


class HttpStack(Protocol):
    """Sends one request and returns its answer once the head is in."""

    @property
    def kind(self) -> HttpTransportKind:
        """Which stack this is."""
        ...

    async def open(
        self, method: str, base_url: str, path: str, content: bytes | None
    ) -> StackAnswer:
        """Send ``method base_url+path`` with ``content`` (JSON) or no body, once."""
        ...

    async def aclose(self) -> None:
        """Close every connection (idempotent)."""
        ...


class HttpxStack:
    """``httpx.AsyncClient`` on httpx's own transport (see module docstring)."""

    def __init__(self, timeout: httpx.Timeout, limits: httpx.Limits) -> None:
        self._client, _ = make_engine_client("httpx", timeout, limits)
        # What the client's build_request would merge into every request, merged once: the
        # client's default headers (its own, never an environment's: trust_env=False) and its
        # timeout. The request on the wire is byte for byte the same (test_transport checks).
        self._plain_headers = httpx.Headers(self._client.headers)
        self._json_headers = httpx.Headers(self._client.headers)
        self._json_headers["content-type"] = "application/json"
        self._timeout = timeout.as_dict()
        self._urls: dict[tuple[str, str], httpx.URL] = {}

    @property
    def kind(self) -> HttpTransportKind:
        return "httpx"

    async def open(
        self, method: str, base_url: str, path: str, content: bytes | None
    ) -> StackAnswer:
        # The request the client's build_request builds, without its per-request merging and
        # URL parsing.
        # httpx.InvalidURL from the URL is raised inside the caller's try: a URL that cannot be
        # requested fails before anything is sent.
        request = httpx.Request(
            method,
            cached_url(self._urls, base_url, path, httpx.URL),
            content=content,
            headers=self._plain_headers if content is None else self._json_headers,
            extensions={"timeout": self._timeout},
        )
        response = await self._client.send(request, stream=True)
        return StackAnswer(
            response.status_code,
            response.encoding or "utf-8",
            response.aread,
            response.aiter_lines,
            response.aclose,
        )

    async def aclose(self) -> None:
        await self._client.aclose()
