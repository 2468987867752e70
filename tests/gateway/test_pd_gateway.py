"""The Session gateway over a PD group: an agent's ``/generate`` reaches the group's PD router
with the Session's exact adapter, and both role servers hold it before the first request."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from agentic_lora.config import load_settings
from agentic_lora.gateway.app import Gateway
from agentic_lora.gateway.client import AdminClient
from agentic_lora.testing.adapters import tiny_snapshot
from agentic_lora.testing.pd_fleet import ScriptedPDFleet

pytestmark = pytest.mark.asyncio

TOKEN = "admin-secret-token"


async def test_a_gateway_session_generates_through_the_pd_router_on_its_version(
    tmp_path: Path,
) -> None:
    adapter = tiny_snapshot(1).write_peft_dir(tmp_path / "a")
    with ScriptedPDFleet(groups=[("g1", 2)]) as fleet:
        settings = load_settings(
            enable_versioned_lora_publication=True,
            capacity=2,
            http_transport="httpx",  # respx intercepts httpx's default transport
            engine_max_loaded_loras=3,
            engine_max_loras_per_batch=3,
            base_model_name="base-model",
            gateway_retries_disabled=True,
            **fleet.settings_values(),
        )
        gateway = await Gateway.from_settings(
            settings, backend_options={"store_root": str(tmp_path / "store")}, admin_token=TOKEN
        )
        async with gateway:
            transport = httpx.ASGITransport(app=gateway.app)
            admin = AdminClient("http://gateway", token=TOKEN, transport=transport)
            published = await admin.publish(str(adapter), "A")
            await admin.aclose()
            registry: Any = gateway.deployment.registry
            lora_name = registry.peek_version("A").lora_name
            for name in ("g1.prefill", "g1.decode0", "g1.decode1"):
                assert fleet[name].holds(lora_name), (name, published)
            async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as agent:
                for turn in ("turn 1", "turn 2"):
                    reply = await agent.post(
                        "/generate",
                        json={"text": turn, "sampling_params": {"max_new_tokens": 1}},
                        headers={"Authorization": "Bearer episode-1"},
                    )
                    assert reply.status_code == 200, reply.text
        sent = fleet.pd_routers["g1"].generates
        assert [b["text"] for b in sent] == ["turn 1", "turn 2"]
        assert {b["lora_path"] for b in sent} == {lora_name}
