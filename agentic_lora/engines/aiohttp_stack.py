"""The ``"aiohttp"`` HTTP stack: an ``aiohttp.ClientSession`` under the engine transport.

See :mod:`agentic_lora.engines.stacks` for the seam. What this stack guarantees, and why:

* **One request per call.** aiohttp follows no redirect here (``allow_redirects=False``) and
  re-sends nothing but an idempotent method (GET, never a POST) on a reused connection the
  server had closed; generations are POSTs.
* **The pool outlives no server keep-alive.** Idle connections expire after the
  ``keepalive_expiry`` of :func:`~agentic_lora.foundation.http_limits.engine_limits`, before
  uvicorn closes them (a request written onto a closing connection would be indeterminate).
* **Timeouts as httpx's.** httpx's ``connect`` is aiohttp's ``sock_connect``, its ``pool`` wait
  aiohttp's ``connect`` (which covers waiting for a pooled connection), its ``read``
  aiohttp's ``sock_read``; no total deadline (a long generation is not a failure).
* **Created in the loop that uses it.** A ``ClientSession`` belongs to one event loop, and a
  transport may be built before any loop runs, so the session is made at the first request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from functools import partial

import aiohttp
import httpx
from yarl import URL

from agentic_lora.engines.stacks import StackAnswer
from agentic_lora.engines.stacks import cached_url
from agentic_lora.engines.wire import HttpTransportKind

__all__ = ["AiohttpStack"]

_JSON = "application/json"


def _parse_url(text: str) -> URL:
    try:
        return URL(text)
    except ValueError as exc:  # raised inside the caller's try: refused, never sent
        raise aiohttp.InvalidUrlClientError(text, str(exc)) from exc


async def _lines(response: aiohttp.ClientResponse, charset: str) -> AsyncIterator[str]:
    # Split by hand rather than with the stream's readline, which refuses a line longer than its
    # buffer: a streamed SGLang chunk carries the whole text so far and can be longer.
    pending = b""
    async for data in response.content.iter_any():
        pending += data
        if b"\n" not in data:
            continue
        *complete, pending = pending.split(b"\n")
        for line in complete:
            yield line.removesuffix(b"\r").decode(charset, errors="replace")
    if pending:
        yield pending.removesuffix(b"\r").decode(charset, errors="replace")


async def _close(response: aiohttp.ClientResponse) -> None:
    # A body read to its end already gave its connection back to the pool; one that was not is
    # cut off here, so the engine sees the client go.
    response.close()


class AiohttpStack:
    """``aiohttp.ClientSession`` used directly (see module docstring)."""

    def __init__(self, timeout: httpx.Timeout, limits: httpx.Limits) -> None:
        self._timeout = aiohttp.ClientTimeout(
            total=None, connect=timeout.pool, sock_connect=timeout.connect, sock_read=timeout.read
        )
        self._limits = limits
        self._session: aiohttp.ClientSession | None = None
        self._urls: dict[tuple[str, str], URL] = {}

    @property
    def kind(self) -> HttpTransportKind:
        return "aiohttp"

    def _start(self) -> aiohttp.ClientSession:
        connector = aiohttp.TCPConnector(
            limit=self._limits.max_connections or 0,
            keepalive_timeout=self._limits.keepalive_expiry,
        )
        # trust_env=False: an environment proxy would be another hop that may retry (or log
        # credentials) between this process and the engine.
        self._session = aiohttp.ClientSession(
            connector=connector, timeout=self._timeout, trust_env=False
        )
        return self._session

    async def open(
        self, method: str, base_url: str, path: str, content: bytes | None
    ) -> StackAnswer:
        session = self._session if self._session is not None else self._start()
        response = await session.request(
            method,
            cached_url(self._urls, base_url, path, _parse_url),
            # The body as a payload that names its own content type: aiohttp takes it as it is
            # and copies its one header, where bytes plus a headers mapping cost a payload-type
            # lookup and a merge of the mapping into the request's headers on every request.
            data=None if content is None else aiohttp.BytesPayload(content, content_type=_JSON),
            allow_redirects=False,
        )
        charset = response.charset or "utf-8"
        return StackAnswer(
            response.status,
            charset,
            response.read,
            partial(_lines, response, charset),
            partial(_close, response),
        )

    async def aclose(self) -> None:
        # The transport refuses to send once closed, so no session is started after this.
        if self._session is not None:
            await self._session.close()
