"""A scripted engine on a real loopback socket, for what respx cannot show.

respx replaces httpx's transport, so it can script neither the aiohttp stack nor how a socket
dies. :class:`LoopbackEngine` is a minimal HTTP/1.1 server on 127.0.0.1 that records every request
it receives and acts out one scripted :data:`Action` per request: an answer (whole or in chunks),
a connection dropped once the request is in, or a hang until the test lets it go. Nothing here
waits on a clock: a hang ends when the engine closes, and each test's verdict is what the engine
received.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from collections.abc import Awaitable
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field
from typing import Any

from aiohttp import web

__all__ = [
    "Action",
    "Answer",
    "Drop",
    "Hang",
    "LoopbackEngine",
    "Seen",
    "loopback_server",
    "read_request",
    "serve_generate",
]


@dataclass(frozen=True, slots=True)
class Answer:
    """Answer ``status`` with ``chunks``, written one by one (chunked encoding); the connection
    stays open for the next request. ``hold``: after the chunks, write nothing more (the body
    never ends) until the engine is closed."""

    status: int = 200
    chunks: tuple[bytes, ...] = (b"{}",)
    content_type: str = "application/json"
    hold: bool = False

    @classmethod
    def json(cls, status: int, body: Any) -> Answer:
        return cls(status, (json.dumps(body).encode(),))


@dataclass(frozen=True, slots=True)
class Drop:
    """Close the connection once the whole request is in: the engine has it, no reply comes."""


@dataclass(frozen=True, slots=True)
class Hang:
    """Hold the request unanswered until the engine is closed."""


Action = Answer | Drop | Hang


@dataclass(frozen=True, slots=True)
class Seen:
    """One request as the engine received it."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """The body of the next request on ``reader`` (its head read and dropped)."""
    return (await _read(reader)).body


async def _read(reader: asyncio.StreamReader) -> Seen:
    head = await reader.readuntil(b"\r\n\r\n")
    request_line, *header_lines = head.decode("latin-1").split("\r\n")
    method, path, _ = request_line.split(" ", 2)
    headers = {}
    for line in header_lines:
        if ":" in line:
            name, value = line.split(":", 1)
            headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return Seen(method, path, headers, body)


@contextlib.asynccontextmanager
async def loopback_server(
    handle: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
) -> AsyncIterator[str]:
    """Serve ``handle`` on a free loopback port; yields the base URL."""
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()
        await server.wait_closed()


@contextlib.asynccontextmanager
async def serve_generate(
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
) -> AsyncIterator[str]:
    """An aiohttp app answering ``POST /generate`` with ``handler`` on a free loopback port;
    yields the base URL (for an engine whose answer is easier written with aiohttp's server)."""
    app = web.Application()
    app.router.add_post("/generate", handler)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


@dataclass
class LoopbackEngine:
    """Acts out ``script`` one action per request (then answers 200 ``{}``); see module doc."""

    script: list[Action] = field(default_factory=list)
    seen: list[Seen] = field(default_factory=list)
    connections: int = 0
    url: str = ""
    _released: asyncio.Event = field(default_factory=asyncio.Event)
    _arrived: asyncio.Condition = field(default_factory=asyncio.Condition)

    async def wait_for_requests(self, n: int) -> None:
        """Until the engine has received ``n`` requests."""
        async with self._arrived:
            await self._arrived.wait_for(lambda: len(self.seen) >= n)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                try:
                    seen = await _read(reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return  # the client closed the connection
                self.seen.append(seen)
                async with self._arrived:
                    self._arrived.notify_all()
                action = self.script.pop(0) if self.script else Answer()
                if isinstance(action, Drop):
                    return
                if isinstance(action, Hang):
                    await self._released.wait()
                    return
                writer.write(
                    f"HTTP/1.1 {action.status} X\r\ncontent-type: {action.content_type}\r\n"
                    "transfer-encoding: chunked\r\n\r\n".encode()
                )
                for chunk in action.chunks:
                    writer.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
                    await writer.drain()
                if action.hold:
                    await self._released.wait()
                    return
                writer.write(b"0\r\n\r\n")
                await writer.drain()
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def __aenter__(self) -> LoopbackEngine:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._released.set()
        self._server.close()
        await self._server.wait_closed()
