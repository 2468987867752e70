"""A loopback HTTP stand-in behind an environment proxy that goes nowhere.

Control-plane clients must never take ``HTTP(S)_PROXY`` from the environment. :func:`direct_only`
starts a real loopback server that answers every request with one JSON body, and points every
proxy variable at a port where nothing listens: a client that honoured the environment fails to
connect, one that goes direct gets the answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

__all__ = ["direct_only"]

_PROXY_VARS = ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")


@contextlib.asynccontextmanager
async def direct_only(
    monkeypatch: pytest.MonkeyPatch, answer: Any
) -> AsyncIterator[tuple[str, list[bytes]]]:
    """``(base_url, heads)``: the stand-in's URL and the head of every request it received."""
    heads: list[bytes] = []
    body = json.dumps(answer).encode()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        heads.append(await reader.readuntil(b"\r\n\r\n"))
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            + f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    dead = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    dead_port = dead.sockets[0].getsockname()[1]
    dead.close()
    await dead.wait_closed()
    for var in _PROXY_VARS:
        monkeypatch.setenv(var, f"http://127.0.0.1:{dead_port}")
    for var in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(var, raising=False)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", heads
    finally:
        server.close()
        await server.wait_closed()
