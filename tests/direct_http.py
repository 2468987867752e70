"""Straight to a server, never through an environment proxy: the tests' own engine client, and a
loopback stand-in behind a proxy that goes nowhere.

:func:`engine_client` is how a test reads real engines itself (baselines, listings, clean-up).
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

import httpx
import pytest

from agentic_lora.foundation.http_limits import engine_limits

__all__ = ["direct_only", "engine_client"]


def engine_client() -> httpx.AsyncClient:
    """A client straight to real engines: no environment proxy, generous timeouts (the engines
    share a small CPU with the test), and idle connections dropped before the engines' uvicorn
    closes them (a request written onto a connection being closed fails as "disconnected")."""
    return httpx.AsyncClient(
        timeout=httpx.Timeout(300.0, connect=10.0), limits=engine_limits(), trust_env=False
    )


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
