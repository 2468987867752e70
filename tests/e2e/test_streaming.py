"""Streaming through the gateway on the real SGLang fleet, with the unmodified ``openai`` client.

Across a publication: an old Session streams on A while B is published, a new Session streams
on B, every chunk names its Session's version, and A is reclaimed only after the old stream
ended (until then its Session holds it). A client that disconnects mid-stream has its engine
request aborted: the engine's own access log shows the ``/abort_request``. The gateway talks to
the engines directly (the recording proxy would buffer a stream whole); the engines are left as
found (every adapter published here is unloaded in teardown).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from agentic_lora.config import load_settings
from agentic_lora.engines.admin import EngineAdminClient
from agentic_lora.gateway.app import Gateway
from agentic_lora.gateway.client import AdminClient
from tests.direct_http import engine_client
from tests.e2e.support import EngineLog
from tests.e2e.support import fresh_id
from tests.streaming_support import served

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(1800)]


def version_of(chunk: Any) -> str:
    return str(chunk.model_extra["agentic_lora"]["version_id"])


@pytest.mark.asyncio
async def test_openai_streams_across_a_publication_and_a_disconnect_aborts(
    engine_fleet: Any, tmp_path: Path
) -> None:
    fixture = engine_fleet.fixture
    base = engine_fleet.served_model_name
    settings = load_settings(
        enable_versioned_lora_publication=True,
        engines=[f"{name}={url}" for name, url in engine_fleet.engines],
        capacity=2,
        base_model_name=base,
        gateway_max_tokens=64,
    )
    gateway = await Gateway.from_settings(
        settings, backend_options={"store_root": str(tmp_path / "store")}, admin_token="t"
    )
    logs = {name: EngineLog(engine_fleet.log_path(name)) for name in engine_fleet.names}
    a_id, b_id = fresh_id("stream-a"), fresh_id("stream-b")
    published: list[str] = []
    turn: dict[str, Any] = {
        "model": base,
        "messages": [{"role": "user", "content": "Count slowly from one to fifty."}],
        "max_tokens": 24,
        "temperature": 0.0,
        "extra_body": {"ignore_eos": True},
    }
    try:
        async with gateway, served(gateway.app) as url:
            admin = AdminClient(url, token="t")

            def agent(session_id: str) -> openai.AsyncOpenAI:
                return openai.AsyncOpenAI(base_url=url + "/v1", api_key=session_id, max_retries=0)

            a = await admin.publish(str(fixture.adapter("A")), a_id)
            published.append(a["lora_name"])
            old, new = agent(fresh_id("old")), agent(fresh_id("new"))
            old_stream = await old.chat.completions.create(**turn, stream=True)
            old_chunks = [await anext(aiter(old_stream))]

            b = await admin.publish(str(fixture.adapter("B")), b_id)
            published.append(b["lora_name"])
            assert b["outcome"] == "PUBLISHED"
            new_chunks = [c async for c in await new.chat.completions.create(**turn, stream=True)]
            old_chunks += [c async for c in old_stream]
            # Until the old stream ended, its Session held A: no reclaim could take it.
            registry: Any = gateway.deployment.registry
            assert registry.peek_version(a_id).session_refs == 1

            assert {version_of(c) for c in old_chunks} == {a_id}
            assert {version_of(c) for c in new_chunks} == {b_id}
            assert len(old_chunks) > 1
            assert len(new_chunks) > 1

            await old.post("/sessions/close", cast_to=httpx.Response)
            assert registry.peek_version(a_id).session_refs == 0
            await admin.reclaim()
            gone = registry.peek_version(a_id)
            assert gone is None or not gone.state.dispatchable

            # A client that leaves mid-stream: the engine is told to abort the request.
            marks = {name: log.offset() for name, log in logs.items()}
            leaver = agent(fresh_id("leaver"))
            long_turn = {**turn, "max_tokens": 64}
            stream = await leaver.chat.completions.create(**long_turn, stream=True)
            assert version_of(await anext(aiter(stream))) == b_id
            await stream.close()
            engine = stream.response.headers["x-agentic-engine"]
            await logs[engine].wait_for_line(
                "/abort_request", since=marks[engine], what="the abort of the abandoned stream"
            )
            assert ("POST", "/abort_request") in logs[engine].requests(since=marks[engine])
            for client in (old, new, leaver):
                await client.post("/sessions/close", cast_to=httpx.Response)
                await client.close()
            await admin.aclose()
    finally:
        async with engine_client() as raw:
            for _, engine_url in engine_fleet.engines:
                async with EngineAdminClient(engine_url, client=raw) as engine_admin:
                    for lora in published:
                        await engine_admin.unload_lora_adapter(lora)
