"""Shared helpers for the streaming tests (no tests here): a Versioning over one scripted engine.

The real LocalRegistry, Versioning, middleware chain and engine transport run; only the engine
is scripted (:mod:`agentic_lora.testing.sglang_engine` / :mod:`agentic_lora.testing.vllm_engine`,
with streamed answers from :mod:`agentic_lora.testing.streams`).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import respx
import uvicorn
from tenacity import wait_none

from agentic_lora.engines.backends import EngineRef
from agentic_lora.engines.transport import EngineTransport
from agentic_lora.foundation.replay import RegistryRetry
from agentic_lora.registry.local import LocalRegistry
from agentic_lora.registry.types import Reservation
from agentic_lora.session import Session
from agentic_lora.session import Versioning
from agentic_lora.session.streaming import StreamChunk
from agentic_lora.testing import publish as verbs
from agentic_lora.testing.sglang_engine import ScriptedSGLangEngine
from agentic_lora.testing.vllm_engine import ScriptedVllmEngine

BASE_MODEL = "base-model"  # what the scripted engines serve
URL = "http://127.0.0.1:32100"


@dataclass
class StreamHarness:
    versioning: Versioning
    registry: LocalRegistry
    engine: ScriptedSGLangEngine | ScriptedVllmEngine
    transport: EngineTransport

    @property
    def sglang(self) -> ScriptedSGLangEngine:
        assert isinstance(self.engine, ScriptedSGLangEngine)
        return self.engine

    @property
    def vllm(self) -> ScriptedVllmEngine:
        assert isinstance(self.engine, ScriptedVllmEngine)
        return self.engine

    async def publish(self, version_id: str) -> Reservation:
        """Publish ``version_id`` by the registry verbs; the engine holds its adapter."""
        r = await verbs.publish_by_verbs(self.registry, version_id, ("e0",), incarnation="inc-1")
        self.engine.register(r.lora_name, f"/adapters/{version_id}")
        return r


@contextlib.asynccontextmanager
async def stream_harness(kind: str = "sglang") -> AsyncIterator[StreamHarness]:
    engine: ScriptedSGLangEngine | ScriptedVllmEngine = (
        ScriptedSGLangEngine("e0", URL, read_digest=None)
        if kind == "sglang"
        else ScriptedVllmEngine("e0", URL, read_digest=lambda path: f"digest-of-{path}")
    )
    registry = LocalRegistry(engines=("e0",), capacity=2)
    transport = EngineTransport(
        [EngineRef("e0", URL)], http_transport="httpx", control_wait=wait_none()
    )
    with respx.mock(assert_all_called=False, assert_all_mocked=True) as router:
        engine.mount(router)
        versioning = Versioning(
            transport=transport,
            registry=registry,
            base_model=BASE_MODEL,
            engine_kind=kind,
            registry_retry=RegistryRetry(attempts=4, wait=wait_none()),
        )
        try:
            yield StreamHarness(versioning, registry, engine, transport)
        finally:
            for stream in _streams(engine):
                stream.gate.set()
            with contextlib.suppress(Exception):
                await versioning.aclose()
            await transport.aclose()
            await registry.aclose()


def _streams(engine: ScriptedSGLangEngine | ScriptedVllmEngine) -> list[Any]:
    if isinstance(engine, ScriptedSGLangEngine):
        return list(engine.streamed.values()) + list(engine.streams)
    return list(engine.streamed) + list(engine.streams)


async def read_all(s: Session, route: Any, request: Any) -> list[StreamChunk]:
    """Every chunk of one stream of ``s``."""
    return [chunk async for chunk in s.stream(route, request)]


@contextlib.asynccontextmanager
async def served(app: Any) -> AsyncIterator[str]:
    """``app`` on a real socket (uvicorn, in this loop), for clients that must disconnect."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    started = asyncio.Event()

    class _Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets=sockets)
            started.set()

    server = _Server(uvicorn.Config(app, lifespan="off", log_config=None))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        await started.wait()
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await serving
        sock.close()
