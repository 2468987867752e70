"""A generation read in full gives its engine connection back to the pool, on both HTTP stacks.

No engine: a small aiohttp app on loopback answers ``/generate`` with a JSON body written in two
parts, its end in a later write. The transport does not close an answer it read in full (the
stack seam's contract: reading the whole body releases it), so if a stack's read did not release
the answer, every later generation would pay a new TCP connection; the test counts the
connections the engine saw.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from aiohttp import web

from agentic_lora.engines.backends import EngineRef
from agentic_lora.engines.transport import EngineTransport
from agentic_lora.engines.wire import HttpTransportKind
from tests.engines.loopback import serve_generate


class SplitReplyEngine:
    """``/generate`` answered in two writes; records each request's connection."""

    def __init__(self) -> None:
        self.connections: list[object] = []

    async def generate(self, request: web.Request) -> web.StreamResponse:
        self.connections.append(request.transport.get_extra_info("peername"))
        body = await request.json()
        answer = web.StreamResponse(headers={"content-type": "application/json"})
        await answer.prepare(request)
        await answer.write(b'{"text": ')
        await asyncio.sleep(0.01)  # the rest of the body in a later write
        await answer.write(f'"{body["text"]}"}}'.encode())
        await answer.write_eof()
        return answer


@pytest_asyncio.fixture
async def engine_url() -> AsyncIterator[tuple[str, SplitReplyEngine]]:
    engine = SplitReplyEngine()
    async with serve_generate(engine.generate) as url:
        yield url, engine


@pytest.mark.asyncio
@pytest.mark.parametrize("stack", ["aiohttp", "httpx"])
async def test_consecutive_generations_reuse_one_engine_connection(
    engine_url: tuple[str, SplitReplyEngine], stack: HttpTransportKind
) -> None:
    url, engine = engine_url
    transport = EngineTransport([EngineRef("e0", url)], http_transport=stack)
    try:
        assert transport.http_transport == stack
        for turn in range(4):
            reply = await transport.send("e0", "/generate", {"text": f"turn {turn}"})
            assert reply.body == {"text": f"turn {turn}"}
    finally:
        await transport.aclose()
    assert len(engine.connections) == 4
    assert len(set(engine.connections)) == 1, engine.connections
