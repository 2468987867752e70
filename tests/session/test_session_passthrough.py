"""Flag off: Sessions are a pass-through that keeps the legacy fixed adapter name untouched."""

from __future__ import annotations

import asyncio
import json

import pytest

from agentic_lora.foundation.requests import GenerateRequest
from agentic_lora.session import SessionPhase
from tests.session_support import harness

pytestmark = pytest.mark.asyncio

LEGACY = {
    "sampling_params": {"max_new_tokens": 16, "temperature": 0.7},
    "text": "héllo — tool turn",
    "lora_path": "policy_lora",
    "return_logprob": True,
    "custom_field": [1, {"nested": None}],
}


async def test_legacy_requests_reach_the_engine_byte_for_byte() -> None:
    async with harness(enabled=False) as h:
        v = h.versioning
        assert not v.enabled
        assert v.registry is None
        async with v.session("legacy") as s:
            await s.generate(LEGACY)
            await s.chat_completions(
                {"model": "base:policy_lora", "messages": [{"role": "user", "content": "x"}]}
            )
            await s.generate({"lora_path": "policy_lora", "whatever": "the engine decides"})
        gen, chat, odd = h.engines.generations()
        assert gen.content == json.dumps(LEGACY, separators=(",", ":"), ensure_ascii=False).encode()
        assert list(gen.body) == list(LEGACY)  # same keys, same order, nothing injected
        assert chat.body == {
            "model": "base:policy_lora",
            "messages": [{"role": "user", "content": "x"}],
        }
        assert odd.body == {"lora_path": "policy_lora", "whatever": "the engine decides"}
        assert s.phase is SessionPhase.CLOSED
        assert s.binding is None
        assert s.release_result is None
        assert sum(h.registry.calls.values()) == 0  # no registry in pass-through mode


async def test_typed_requests_and_abort_work_in_pass_through() -> None:
    async with harness(enabled=False) as h:
        s = h.versioning.open_session("legacy")
        await s.generate(GenerateRequest(text="x", lora_path="policy_lora"))
        assert h.engines.generations()[0].body == {"text": "x", "lora_path": "policy_lora"}
        h.engines.actions.append("hold")
        pending = asyncio.create_task(
            s.generate({"text": "long", "rid": "legacy-1", "lora_path": "policy_lora"})
        )
        await h.engines.wait_held(1)
        assert not await s.abort("unknown-rid")
        await s.close()  # aborts the in-flight request, then drains it
        assert (await pending).aborted
        assert [a.body for a in h.engines.aborts] == [{"rid": "legacy-1"}]
