"""A finished stream gives its engine connection back to the pool.

No engine: a small aiohttp app on loopback answers ``/generate`` as SGLang streams it (chunks,
``data: [DONE]``, then the end of the body in a later write). The real registry, Versioning,
middleware chain and engine transport (aiohttp, the product's default) run. An answer closed
before its end closes its connection, and every later stream then paid a new TCP connection to
the engine before its first chunk; the test counts the connections the engine saw.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from aiohttp import web
from tenacity import wait_none

from agentic_lora.engines.backends import EngineRef
from agentic_lora.engines.transport import EngineTransport
from agentic_lora.foundation.replay import RegistryRetry
from agentic_lora.foundation.requests import Route
from agentic_lora.registry.local import LocalRegistry
from agentic_lora.session import Versioning
from agentic_lora.testing import publish as verbs
from tests.engines.loopback import serve_generate


class StreamingEngine:
    """``/generate`` streamed as SGLang does; records each request's connection."""

    def __init__(self) -> None:
        self.connections: list[object] = []

    async def generate(self, request: web.Request) -> web.StreamResponse:
        self.connections.append(request.transport.get_extra_info("peername"))
        await request.read()
        answer = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await answer.prepare(request)
        for text in ("x", "xx"):
            await answer.write(f"data: {json.dumps({'text': text, 'meta_info': {}})}\n\n".encode())
        await answer.write(b"data: [DONE]\n\n")
        # The end of the body follows in a write of its own, as from a streaming ASGI answer;
        # a client that closes at [DONE] has not read it. (A shorter pause only makes a client
        # that does close early likelier to get away with it; it cannot fail one that reads on.)
        await asyncio.sleep(0.05)
        await answer.write_eof()
        return answer


@pytest_asyncio.fixture
async def engine_url() -> AsyncIterator[tuple[str, StreamingEngine]]:
    engine = StreamingEngine()
    async with serve_generate(engine.generate) as url:
        yield url, engine


@pytest.mark.asyncio
async def test_consecutive_streams_of_a_session_reuse_one_engine_connection(
    engine_url: tuple[str, StreamingEngine],
) -> None:
    url, engine = engine_url
    registry = LocalRegistry(engines=("e0",), capacity=2)
    transport = EngineTransport([EngineRef("e0", url)], control_wait=wait_none())
    versioning = Versioning(
        transport=transport,
        registry=registry,
        base_model="base",
        registry_retry=RegistryRetry(attempts=4, wait=wait_none()),
    )
    try:
        await verbs.publish_by_verbs(registry, "A", ("e0",), incarnation="inc-1")
        session = versioning.open_session("s")
        for turn in range(4):
            chunks = [c async for c in session.stream(Route.GENERATE, {"text": f"turn {turn}"})]
            assert [c.data["text"] for c in chunks] == ["x", "xx"]
            assert {c.version_id for c in chunks} == {"A"}
        await session.close()
    finally:
        await versioning.aclose()
        await transport.aclose()
        await registry.aclose()
    assert len(engine.connections) == 4
    assert len(set(engine.connections)) == 1, engine.connections
