"""Rules 3.4-3 and 7.3-3 on real engines: one engine refuses B: A is unchanged, B leaves no trace.

E1 is handed a bad adapter path for B (the recording proxy rewrites ``lora_path`` of that one
``/load_lora_adapter``), so the real engine refuses the load while E0 loads and probes B. The
publisher aborts the attempt and cleans up on both engines: E0 unloads B, E1 confirms it holds
nothing. The result is FAILED_CLEAN, B's slot is free again, the default never moved: Sessions
bound to A, and Sessions opened afterwards, get exactly the outputs they got before.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from agentic_lora.errors import BackendRefusedError
from agentic_lora.publication.publisher import PublicationOutcome
from agentic_lora.registry.types import VersionState
from agentic_lora.session import Session
from tests.e2e.conftest import Stack
from tests.e2e.recording_proxy import Exchange
from tests.e2e.recording_proxy import Rule
from tests.e2e.support import fresh_id
from tests.e2e.support import scored
from tests.e2e.support import scored_request
from tests.e2e.support import stored_names

pytestmark = [pytest.mark.engine, pytest.mark.slow]


async def _ask(
    session: Session, engine: str, prompt: list[int]
) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """Output tokens and every token's logprob of one greedy generation."""
    reply = await session.generate(scored_request(prompt, max_new_tokens=8, rid=fresh_id("ask")))
    assert reply.engine == engine
    result = scored(reply.body)
    return result.output_ids, result.logprobs


@pytest.mark.asyncio
async def test_one_engine_refusing_b_leaves_a_unchanged_and_b_cleaned_up(stack: Stack) -> None:
    assert (await stack.publish("A")).outcome is PublicationOutcome.PUBLISHED
    name_a = stack.lora_name("A")
    prompt = stack.chat.first_turn("compute the sum and answer the question")
    sessions: dict[str, Session] = {}
    before: dict[str, tuple[tuple[int, ...], tuple[float, ...]]] = {}
    for engine in stack.engine_names:
        sessions[engine] = await stack.open_on(engine, f"a-{engine}")
        before[engine] = await _ask(sessions[engine], engine, prompt)

    b_id = stack.version_id("B")

    def load_of_b(e: Exchange) -> bool:
        return e.path == "/load_lora_adapter" and b_id in (e.lora or "")

    def bad_path(body: Mapping[str, Any]) -> Mapping[str, Any]:
        return {**body, "lora_path": f"{body['lora_path']}-does-not-exist"}

    stack.proxies["E1"].add_rule(Rule("bad adapter path for B", load_of_b, rewrite=bad_path))
    result = await stack.publish("B")

    assert result.outcome is PublicationOutcome.FAILED_CLEAN
    reports = {r.engine: r for r in result.engines}
    assert (reports["E0"].ready, reports["E0"].cleaned) == (True, True)
    assert (reports["E1"].ready, reports["E1"].cleaned) == (False, True)
    assert reports["E1"].error_code == BackendRefusedError.code
    name_b = stack.lora_name("B")
    # E1 really refused: the engine answered the (rewritten) load itself.
    (refused_load,) = stack.traffic.select(engine="E1", path="/load_lora_adapter", lora=name_b)
    assert refused_load.forwarded
    assert refused_load.rule == "bad adapter path for B"
    assert refused_load.status == 400
    assert refused_load.reply["success"] is False
    # Cleanup ran on both engines: E0 unloaded B, E1 confirmed it holds nothing.
    (unload_e0,) = stack.traffic.select(engine="E0", path="/unload_lora_adapter", lora=name_b)
    (unload_e1,) = stack.traffic.select(engine="E1", path="/unload_lora_adapter", lora=name_b)
    assert unload_e0.reply["success"] is True
    assert unload_e1.reply["success"] is False
    assert "does not exist" in unload_e1.reply["error_message"]

    b_status = stack.registry.peek_version(b_id)
    assert b_status is not None
    assert b_status.state is VersionState.FAILED_CLEAN
    assert set(b_status.cleaned_engines) == {"E0", "E1"}
    status = await stack.registry.status()
    assert status.default_version == stack.versions["A"]
    assert status.slots_in_use == 1
    for engine in stack.engine_names:
        listed = await stack.raw.get(f"{stack.engine_url(engine)}/v1/models")
        ids = {card["id"] for card in listed.json()["data"]}
        assert name_a in ids, engine
        assert name_b not in ids, engine
        assert name_b not in stored_names(stack.store_root, engine)

    # A's outputs are unchanged, for the Sessions already bound and for a new one.
    for engine in stack.engine_names:
        assert await _ask(sessions[engine], engine, prompt) == before[engine]
        newcomer = await stack.open_on(engine, f"after-{engine}")
        assert await _ask(newcomer, engine, prompt) == before[engine]
        binding = newcomer.binding
        assert binding is not None
        assert binding.lora_name == name_a
    for sent in stack.traffic.select(path="/generate"):
        if sent.field("rid") is not None:  # Session traffic (the probes carry no rid)
            assert sent.lora == name_a
