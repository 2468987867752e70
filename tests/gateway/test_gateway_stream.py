"""Streamed answers of the gateway: SSE on the OpenAI routes and /generate, the version on every
chunk and in ``X-Agentic-Version``, the final error event, and a client disconnect that aborts
the engine request (proved from the scripted engine's side).

A started gateway over scripted SGLang engines (the real registry, publisher, Sessions and
middleware); the OpenAI routes of the scripted engines stream :class:`ScriptedStream` answers.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from agentic_lora.testing.sglang_engine import EngineOp
from agentic_lora.testing.sglang_engine import Fault
from agentic_lora.testing.sglang_engine import FaultKind
from agentic_lora.testing.streams import ScriptedStream
from agentic_lora.testing.streams import StreamEnding
from agentic_lora.testing.streams import generate_chunks
from tests.gateway.test_gateway import BASE_MODEL
from tests.gateway.test_gateway import gateway_stack
from tests.gateway.test_gateway import lora_name
from tests.streaming_support import served

pytestmark = pytest.mark.asyncio

CHAT = {"model": BASE_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def events(text: str) -> list[Any]:
    """The decoded ``data:`` payloads of an SSE body (``[DONE]`` kept as the string)."""
    out: list[Any] = []
    for line in text.splitlines():
        if line.startswith("data: "):
            payload = line[6:]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


async def test_openai_client_streams_on_a_and_b_across_a_publication(tmp_path: Path) -> None:
    async with gateway_stack(tmp_path, published="A") as stack:
        old = stack.agent("episode-old")
        first = await old.chat.completions.create(**CHAT, stream=True)
        on_a = [chunk async for chunk in first]
        await stack.publish("B", 2)
        new = stack.agent("episode-new")
        raw = await new.chat.completions.with_raw_response.create(**CHAT, stream=True)
        assert raw.headers["x-agentic-version"] == "B"
        assert raw.headers["x-agentic-lora-name"] == lora_name(stack, "B")
        assert raw.headers["content-type"].startswith("text/event-stream")
        on_b = [chunk async for chunk in raw.parse()]
        again = [
            c async for c in await old.completions.create(model=BASE_MODEL, prompt="p", stream=True)
        ]

        def versions(chunks: list[Any]) -> list[str]:
            return [c.model_extra["agentic_lora"]["version_id"] for c in chunks]

        assert versions(on_a) == ["A"] * 3
        assert versions(on_b) == ["B"] * 3
        assert versions(again) == ["A"] * 3
        assert "".join(c.choices[0].delta.content or "" for c in on_a) == "xxx"
        assert [body["model"] for _, _, body in stack.routes.sent] == [
            f"{BASE_MODEL}:{lora_name(stack, 'A')}",
            f"{BASE_MODEL}:{lora_name(stack, 'B')}",
            f"{BASE_MODEL}:{lora_name(stack, 'A')}",
        ]
        assert all(body["stream"] is True for _, _, body in stack.routes.sent)


async def test_generate_streams_carry_the_version_in_meta_info(tmp_path: Path) -> None:
    async with gateway_stack(tmp_path, published="A") as stack:
        response = await stack.http().post(
            "/generate",
            json={"text": "hi", "stream": True},
            headers={"authorization": "Bearer gen-1"},
        )
        assert response.status_code == 200
        assert response.headers["x-agentic-version"] == "A"
        got = events(response.text)
        assert got[-1] == "[DONE]"
        metas = [e["meta_info"] for e in got[:-1]]
        assert [m["agentic_lora"]["version_id"] for m in metas] == ["A"] * 3
        assert [e["text"] for e in got[:-1]] == ["x", "xx", "xxx"]
        assert {m["lora_path"] for m in metas} == {lora_name(stack, "A")}


@pytest.mark.parametrize(
    ("fault", "status", "outcome", "code"),
    [
        (FaultKind.REFUSE, 400, "refused", "REQUEST_REFUSED"),
        (FaultKind.SERVER_ERROR, 502, "indeterminate", "REQUEST_INDETERMINATE"),
    ],
)
async def test_a_failure_before_the_first_chunk_is_an_ordinary_error_answer(
    tmp_path: Path, fault: FaultKind, status: int, outcome: str, code: str
) -> None:
    async with gateway_stack(tmp_path, published="A") as stack:
        for engine in stack.fleet.engines.values():
            engine.script(EngineOp.GENERATE, Fault(fault))
        response = await stack.http().post(
            "/generate",
            json={"text": "hi", "stream": True},
            headers={"authorization": "Bearer gen-1"},
        )
        assert response.status_code == status
        assert response.headers["x-agentic-outcome"] == outcome
        assert response.headers["content-type"] == "application/json"
        assert response.json()["error"]["code"] == code


async def test_a_failure_mid_stream_ends_with_a_final_error_event(tmp_path: Path) -> None:
    async with gateway_stack(tmp_path, published="A") as stack:
        for engine in stack.fleet.engines.values():
            engine.streams.append(
                ScriptedStream(generate_chunks(3, None, None)[:2], ending=StreamEnding.ERROR)
            )
        response = await stack.http().post(
            "/generate",
            json={"text": "hi", "stream": True},
            headers={"authorization": "Bearer gen-1"},
        )
        got = events(response.text)
        assert [e["text"] for e in got[:2]] == ["x", "xx"]
        assert "[DONE]" not in got
        error = got[-1]["error"]
        assert error["code"] == "REQUEST_INDETERMINATE"
        assert error["details"]["chunks"] == 2
        # The openai client raises it rather than end the stream quietly.
        agent = stack.agent("chat-1")
        for engine in stack.fleet.engines.values():
            engine.streams.clear()
            engine.streams.append(ScriptedStream(ending=StreamEnding.DROP))
        with pytest.raises(openai.APIError) as err:
            await drain(await agent.chat.completions.create(**CHAT, stream=True))
        assert err.value.body["code"] == "REQUEST_INDETERMINATE"  # type: ignore[index]
        assert err.value.body["details"]["chunks"] == 3  # type: ignore[index]


async def drain(stream: AsyncIterator[Any]) -> None:
    async for _ in stream:
        pass


async def test_a_client_disconnect_aborts_the_engine_request(tmp_path: Path) -> None:
    async with gateway_stack(tmp_path, published="A") as stack:
        held = [ScriptedStream(hold_after=1) for _ in stack.fleet.engines]
        for engine, stream in zip(stack.fleet.engines.values(), held, strict=True):
            engine.streams.append(stream)
        async with served(stack.gateway.app) as url, aiohttp.ClientSession() as client:
            response = await client.post(
                url + "/generate",
                json={"text": "hi", "stream": True},
                headers={"authorization": "Bearer gen-1"},
            )
            assert response.headers["x-agentic-version"] == "A"
            line = await response.content.readline()
            assert json.loads(line.removeprefix(b"data: "))["text"] == "x"
            response.close()  # the client goes away mid-stream
            (engine,) = [e for e in stack.fleet.engines.values() if e.streamed]
            ((rid, stream),) = engine.streamed.items()
            await stream.aborted.wait()
        assert engine.bodies(EngineOp.ABORT) == [{"rid": rid}]
        generations = engine.count(EngineOp.GENERATE)
        session = stack.gateway.versioning.get("gen-1")
        assert session is not None
        while session.in_flight:
            await session._wait_drained()  # type: ignore[attr-defined]
        assert stack.gateway.versioning.in_flight(lora_name(stack, "A")) == 0
        # The Session stays usable and nothing was retried.
        again = await stack.http().post(
            "/generate", json={"text": "more"}, headers={"authorization": "Bearer gen-1"}
        )
        assert again.status_code == 200
        assert engine.count(EngineOp.GENERATE) == generations + 1
