"""Streaming through the gateway on the real vLLM fleet, with the unmodified ``openai`` client.

An old Session streams on A, B is published, a new Session streams on B: every chunk names its
Session's version. A held stream (the engine gate, ``tests/vllm/engine_gate.py``) keeps A in
flight while its Session's ref is dropped: the reclaim waits for the stream, which then ends in
full on A. A client that leaves a held stream mid-way has its engine connection closed, which is
how vLLM learns of it: with the engine let through one step at a time, the request generated far
fewer tokens than it asked for.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from agentic_lora_harness.vllm_engines import VllmFleet
from prometheus_client.parser import text_string_to_metric_families

from agentic_lora.gateway.app import Gateway
from agentic_lora.gateway.client import AdminClient
from agentic_lora.publication.reclaimer import ReclaimOutcome
from agentic_lora.registry.types import new_request_id
from tests.direct_http import engine_client
from tests.session_support import Calls
from tests.streaming_support import served
from tests.vllm.engine_gate import WAIT_GUARD_SECONDS
from tests.vllm.engine_gate import EngineGate
from tests.vllm.support import vllm_settings

pytestmark = [pytest.mark.engine, pytest.mark.vllm, pytest.mark.slow]


def version_of(chunk: Any) -> str:
    return str(chunk.model_extra["agentic_lora"]["version_id"])


async def counters(http: httpx.AsyncClient, url: str) -> dict[str, float]:
    """Running requests and generated tokens of one engine (summed over its label sets)."""
    page = (await http.get(f"{url}/metrics")).raise_for_status().text
    out = {"running": 0.0, "tokens": 0.0}
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            if sample.name == "vllm:num_requests_running":
                out["running"] += sample.value
            elif sample.name == "vllm:generation_tokens_total":
                out["tokens"] += sample.value
    return out


async def release_until_gone(gate: EngineGate, http: httpx.AsyncClient, url: str) -> int:
    """Let a stepwise gate's request pass one step at a time until the engine runs no request;
    return how many steps passed. Each step waits for the engine to hold the next one or to run
    nothing, so the count is the engine's, not the test's speed."""
    released = 0
    async with asyncio.timeout(WAIT_GUARD_SECONDS):
        while True:
            step = gate.release_step()
            released += 1
            # The engine is another process: the marker and its counters are its only signals.
            while gate.held_step() == step:
                if not (await counters(http, url))["running"]:
                    return released
                await asyncio.sleep(0.05)


@pytest.mark.asyncio
async def test_vllm_streams_across_a_publication_hold_a_for_reclaim_and_end_on_disconnect(
    vllm_fleet: VllmFleet, engine_gate: EngineGate, tmp_path: Path
) -> None:
    fixture = vllm_fleet.fixture
    urls = dict(vllm_fleet.engines)
    settings = vllm_settings(vllm_fleet, "e2e_vllm_stream", gateway_max_tokens=256)
    turn: dict[str, Any] = {
        "model": fixture.served_model_name,
        "prompt": "def add",
        "max_tokens": 8,
        "temperature": 0.0,
    }
    gateway = await Gateway.from_settings(
        settings, backend_options={"store_root": str(tmp_path / "store")}, admin_token="t"
    )
    names: list[str] = []
    clients: list[openai.AsyncOpenAI] = []
    leaver_gate = EngineGate(tmp_path, "leaver", stepwise=True)
    async with engine_client() as http:
        try:
            async with gateway, served(gateway.app) as url:
                admin = AdminClient(url, token="t", timeout=300.0)

                def agent(session_id: str) -> openai.AsyncOpenAI:
                    return openai.AsyncOpenAI(
                        base_url=url + "/v1", api_key=session_id, max_retries=0
                    )

                names.append((await admin.publish(str(fixture.adapter("A")), "vs-a"))["lora_name"])
                old, new = agent("old-episode"), agent("new-episode")
                clients.extend((old, new))
                first = [c async for c in await old.completions.create(**turn, stream=True)]
                names.append((await admin.publish(str(fixture.adapter("B")), "vs-b"))["lora_name"])
                on_b = [c async for c in await new.completions.create(**turn, stream=True)]
                assert {version_of(c) for c in first} == {"vs-a"}
                assert {version_of(c) for c in on_b} == {"vs-b"}

                # A held stream of the old Session keeps A in flight while its ref is dropped.
                held = await old.completions.create(
                    **{**turn, "max_tokens": 32, "extra_body": {"vllm_xargs": engine_gate.xargs}},
                    stream=True,
                )
                chunks = [await anext(aiter(held))]
                await engine_gate.reached(what="the old Session's held stream on A")
                registry: Any = gateway.deployment.registry
                session = gateway.versioning.live_sessions()
                (old_session,) = [
                    s for s in session if s.binding and s.binding.version_id == "vs-a"
                ]
                assert gateway.versioning.in_flight(names[0]) == 1
                waits = Calls()
                gateway.versioning.on_drain_wait.append(waits)
                await registry.begin_close(request_id=new_request_id(), session_key=old_session.key)
                await registry.release(request_id=new_request_id(), session_key=old_session.key)
                reclaim = asyncio.create_task(gateway.deployment.reclaimer.reclaim_version("vs-a"))
                waiting = asyncio.create_task(waits.wait())
                done, _ = await asyncio.wait(
                    {reclaim, waiting}, return_when=asyncio.FIRST_COMPLETED
                )
                assert done == {waiting}, "the reclaim did not wait for the open stream"
                engine_gate.open()
                chunks += [c async for c in held]
                assert {version_of(c) for c in chunks} == {"vs-a"}
                assert chunks[-1].choices[0].finish_reason == "length"
                assert (await reclaim).outcome is ReclaimOutcome.RECLAIMED

                # A client that leaves a held stream: the engine stops generating for it. The
                # gate holds the request at every step from its second on and the test lets the
                # steps pass one by one, so how many tokens the engine made after the client
                # left is counted, not raced: vLLM learns of the disconnect only when it next
                # writes a chunk, and a gate that opened at once would let the engine run on
                # for as long as its API server took to notice.
                leaver = agent("leaver")
                clients.append(leaver)
                asked = 200
                stream = await leaver.completions.create(
                    **{
                        **turn,
                        "max_tokens": asked,
                        "extra_body": {"vllm_xargs": leaver_gate.xargs, "ignore_eos": True},
                    },
                    stream=True,
                )
                engine = stream.response.headers["x-agentic-engine"]
                before = await counters(http, urls[engine])
                assert version_of(await anext(aiter(stream))) == "vs-b"
                await leaver_gate.reached(what="the leaver's stream")
                await stream.close()
                async with asyncio.timeout(WAIT_GUARD_SECONDS):
                    # The gateway ends its engine stream as soon as the client is gone.
                    await gateway.versioning.wait_drained(names[1])
                released = await release_until_gone(leaver_gate, http, urls[engine])
                after = await counters(http, urls[engine])
                assert released < asked / 2, f"the engine made {released} steps after the leave"
                assert after["tokens"] - before["tokens"] < asked / 2
                await admin.aclose()
        finally:
            leaver_gate.open()  # a failed run never leaves an engine held
            for client in clients:
                await client.close()
            for base in urls.values():
                for name in names:
                    await http.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": name})
