"""Real agent frameworks roll out through the gateway on the real SGLang fleet, one Session per run.

Two smolagents ``CodeAgent`` runs (``OpenAIServerModel``) and one openai-agents SDK conversation
start on version A; each names its Session with ``X-Session-ID`` under one gateway API key (what
verifiers does). After their first turn, B is published; then they go on (the smolagents agents
fail to parse the random model's output and run to ``max_steps``; the openai-agents
conversation takes a second run in the same Session), and new runs of both frameworks start.
Every reply's ``X-Agentic-Version`` is recorded by an HTTP hook on the framework's own client:

* every run's turns carried one version;
* the runs started before the publication stayed on A, also after B committed;
* the runs started after the commit carried B.

A raw turn asking for token ids and logprobs shows what a trainer reads from a gateway rollout
(:func:`~agentic_lora.gateway.tokens.turn_tokens`). Nothing is fetched: the frameworks only talk
to the gateway, tracing and telemetry are off. The engines are left as found.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from agentic_lora.config import load_settings
from agentic_lora.engines.admin import EngineAdminClient
from agentic_lora.gateway.app import Gateway
from agentic_lora.gateway.client import AdminClient
from agentic_lora.gateway.tokens import CHAT_TOKEN_FIELDS
from agentic_lora.gateway.tokens import turn_tokens
from tests.direct_http import engine_client
from tests.e2e.support import fresh_id
from tests.streaming_support import served

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(1200)]

logger = logging.getLogger(__name__)
API_KEY = "rollout-key-0123456789"
MAX_STEPS = 4
HANG_GUARD = 600.0


class Turns:
    """The version of every reply, per ``X-Session-ID``; a run marked ``gated`` waits after its
    first turn until ``published`` is set (from any thread)."""

    def __init__(self) -> None:
        self.versions: dict[str, list[str]] = defaultdict(list)
        self.first: dict[str, threading.Event] = {}
        self.published = threading.Event()

    def gate(self, session: str) -> None:
        self.first[session] = threading.Event()

    def record(self, response: httpx.Response) -> bool:
        session = response.request.headers["x-session-id"]
        assert response.status_code == 200, response.status_code
        self.versions[session].append(response.headers["x-agentic-version"])
        gate = self.first.get(session)
        if gate is None or gate.is_set():
            return False
        gate.set()
        return True

    def sync_hook(self, response: httpx.Response) -> None:
        if self.record(response):
            assert self.published.wait(HANG_GUARD)

    async def async_hook(self, response: httpx.Response) -> None:
        self.record(response)


def smol_run(url: str, model_name: str, session: str, turns: Turns) -> Any:
    """One smolagents CodeAgent run in this thread (its client is synchronous)."""
    with httpx.Client(event_hooks={"response": [turns.sync_hook]}) as http:
        return _smol_run(url, model_name, session, http)


def _smol_run(url: str, model_name: str, session: str, http: httpx.Client) -> Any:
    from smolagents import CodeAgent
    from smolagents import OpenAIServerModel
    from smolagents.agents import EMPTY_PROMPT_TEMPLATES
    from smolagents.monitoring import LogLevel

    model = OpenAIServerModel(
        model_id=model_name,
        api_base=url + "/v1",
        api_key=API_KEY,
        client_kwargs={
            "default_headers": {"X-Session-ID": session},
            "http_client": http,
            "max_retries": 0,
        },
        max_tokens=16,
        temperature=0.0,
    )
    # Short prompts: the fixture model's context is 4096 tokens.
    templates = {
        **EMPTY_PROMPT_TEMPLATES,
        "system_prompt": "Solve the task with Python code between <code> and </code>.",
        "final_answer": {"pre_messages": "Give a final answer.", "post_messages": "{{task}}"},
    }
    agent = CodeAgent(
        tools=[],
        model=model,
        max_steps=MAX_STEPS,
        prompt_templates=templates,  # type: ignore[arg-type]
        verbosity_level=LogLevel.OFF,
    )
    return agent.run("What is 2 + 3?")


@pytest.mark.asyncio
async def test_smolagents_and_openai_agents_runs_each_stay_on_one_version(
    engine_fleet: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from agents import Agent
    from agents import ModelSettings
    from agents import OpenAIChatCompletionsModel
    from agents import Runner
    from agents import set_tracing_disabled

    set_tracing_disabled(True)
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
        settings,
        backend_options={"store_root": str(tmp_path / "store")},
        admin_token="t",
        api_keys=[API_KEY],
    )
    a_id, b_id = fresh_id("agents-a"), fresh_id("agents-b")
    published: list[str] = []
    turns = Turns()
    clients: list[openai.AsyncOpenAI] = []
    try:
        async with gateway, served(gateway.app) as url:
            admin = AdminClient(url, token="t")

            def sdk_agent(session: str) -> Agent[Any]:
                client = openai.AsyncOpenAI(
                    base_url=url + "/v1",
                    api_key=API_KEY,
                    default_headers={"X-Session-ID": session},
                    http_client=httpx.AsyncClient(event_hooks={"response": [turns.async_hook]}),
                    max_retries=0,
                )
                clients.append(client)
                return Agent(
                    name="assistant",
                    instructions="Answer briefly.",
                    model=OpenAIChatCompletionsModel(model=base, openai_client=client),
                    model_settings=ModelSettings(max_tokens=16, temperature=0.0),
                )

            a = await admin.publish(str(fixture.adapter("A")), a_id)
            published.append(a["lora_name"])
            assert a["outcome"] == "PUBLISHED"

            # Before the publication: two smolagents runs (held after their first turn) and
            # the first run of an openai-agents conversation.
            old_smol = [fresh_id(f"smol-old{i}") for i in range(2)]
            for session in old_smol:
                turns.gate(session)
            old_runs = [
                asyncio.create_task(asyncio.to_thread(smol_run, url, base, s, turns))
                for s in old_smol
            ]
            old_sdk = fresh_id("sdk-old")
            conversation = sdk_agent(old_sdk)
            first = await Runner.run(conversation, "Say hello.", max_turns=2)
            for session in old_smol:
                assert await asyncio.to_thread(turns.first[session].wait, HANG_GUARD)

            b = await admin.publish(str(fixture.adapter("B")), b_id)
            published.append(b["lora_name"])
            assert b["outcome"] == "PUBLISHED"
            turns.published.set()

            # After the commit: the old runs go on; new runs of both frameworks start.
            follow_up = [*first.to_input_list(), {"role": "user", "content": "Again."}]
            await Runner.run(conversation, follow_up, max_turns=2)  # type: ignore[arg-type]
            new_smol = [fresh_id(f"smol-new{i}") for i in range(2)]
            new_sdk = fresh_id("sdk-new")
            await asyncio.gather(
                *old_runs,
                *(asyncio.to_thread(smol_run, url, base, s, turns) for s in new_smol),
                Runner.run(sdk_agent(new_sdk), "Say hello.", max_turns=2),
            )

            versions = turns.versions
            logger.info("turns per run", extra={"turns": {s: len(v) for s, v in versions.items()}})
            for session in [*old_smol, *new_smol]:
                # Unparsable code every step: a call per step up to max_steps, then the final
                # answer (for the old runs: one turn before the publication, the rest after).
                assert len(versions[session]) == MAX_STEPS + 1, (session, versions[session])
            assert len(versions[old_sdk]) == 2
            assert len(versions[new_sdk]) == 1
            for session in [*old_smol, old_sdk]:
                assert set(versions[session]) == {a_id}, session
            for session in [*new_smol, new_sdk]:
                assert set(versions[session]) == {b_id}, session

            # What a trainer reads from a gateway turn: token ids and logprobs, and the version.
            raw = await clients[0].chat.completions.with_raw_response.create(
                model=base,
                messages=[{"role": "user", "content": "One more."}],
                max_tokens=8,
                extra_body=dict(CHAT_TOKEN_FIELDS),
            )
            tokens = turn_tokens(raw.http_response.json())
            assert tokens.version_id == a_id
            assert tokens.prompt_ids
            assert len(tokens.completion_ids) == len(tokens.logprobs) > 0
            assert all(lp <= 0.0 for lp in tokens.logprobs)
            await admin.aclose()
    finally:
        for client in clients:
            await client.close()
        async with engine_client() as raw_client:
            for _, engine_url in engine_fleet.engines:
                async with EngineAdminClient(engine_url, client=raw_client) as engine_admin:
                    for lora in published:
                        await engine_admin.unload_lora_adapter(lora)
