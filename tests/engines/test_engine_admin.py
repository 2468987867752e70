"""The SGLang control client: request shapes, body checks and refused/ambiguous classification."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import pytest
import pytest_asyncio
import respx

from agentic_lora.engines.admin import EngineAdminClient
from agentic_lora.engines.admin import UnloadOutcome
from agentic_lora.engines.admin import server_fingerprint
from agentic_lora.errors import BackendAmbiguousError
from agentic_lora.errors import BackendRefusedError
from tests.direct_http import direct_only

BASE = "http://127.0.0.1:30000"
NAME = "policy_lora@0-v1-0123456789abcdef"
PATH = "/srv/adapters/e0/policy_lora@0-v1-0123456789abcdef"


@pytest_asyncio.fixture
async def admin() -> AsyncIterator[EngineAdminClient]:
    client = EngineAdminClient(BASE, engine="e0")
    yield client
    await client.aclose()


def _lora_body(
    success: bool, error: str | None = None, loaded: dict[str, str] | None = None
) -> dict[str, object]:
    return {"success": success, "error_message": error, "loaded_adapters": loaded or {}}


@pytest.mark.asyncio
@respx.mock
async def test_load_sends_name_path_pinned_and_checks_listing(admin: EngineAdminClient) -> None:
    route = respx.post(f"{BASE}/load_lora_adapter").respond(
        200, json=_lora_body(True, loaded={NAME: PATH})
    )
    result = await admin.load_lora_adapter(NAME, PATH)
    assert json.loads(route.calls.last.request.content) == {
        "lora_name": NAME,
        "lora_path": PATH,
        "pinned": True,
    }
    assert result.lora_path == PATH
    assert result.loaded_adapters == {NAME: PATH}


@pytest.mark.asyncio
@respx.mock
async def test_load_http_200_with_success_false_is_a_failure(admin: EngineAdminClient) -> None:
    respx.post(f"{BASE}/load_lora_adapter").respond(200, json=_lora_body(False, "no room"))
    with pytest.raises(BackendRefusedError, match="no room"):
        await admin.load_lora_adapter(NAME, PATH)


@pytest.mark.asyncio
@respx.mock
async def test_load_success_without_the_adapter_listed_is_ambiguous(
    admin: EngineAdminClient,
) -> None:
    respx.post(f"{BASE}/load_lora_adapter").respond(
        200, json=_lora_body(True, loaded={"other": "/x"})
    )
    with pytest.raises(BackendAmbiguousError, match="does not list"):
        await admin.load_lora_adapter(NAME, PATH)


@pytest.mark.asyncio
@respx.mock
async def test_load_refused_while_the_name_is_held_is_ambiguous(admin: EngineAdminClient) -> None:
    # "already loaded" (or a partial load on some rank): the engine holds something by that name.
    respx.post(f"{BASE}/load_lora_adapter").respond(
        400,
        json=_lora_body(
            False,
            f"Failed to load LoRA adapter {NAME} because it is already loaded",
            {NAME: "/old"},
        ),
    )
    with pytest.raises(BackendAmbiguousError) as info:
        await admin.load_lora_adapter(NAME, PATH)
    assert info.value.details["listed_path"] == "/old"


@pytest.mark.asyncio
@respx.mock
async def test_transport_failures_split_by_whether_the_request_left(
    admin: EngineAdminClient,
) -> None:
    route = respx.post(f"{BASE}/load_lora_adapter")
    route.side_effect = httpx.ConnectError("refused")
    with pytest.raises(BackendRefusedError):
        await admin.load_lora_adapter(NAME, PATH)
    route.side_effect = httpx.ReadTimeout("slow")
    with pytest.raises(BackendAmbiguousError):
        await admin.load_lora_adapter(NAME, PATH)
    route.side_effect = httpx.ReadError("reset")
    with pytest.raises(BackendAmbiguousError):
        await admin.load_lora_adapter(NAME, PATH)


@pytest.mark.asyncio
@respx.mock
async def test_server_errors_and_unparseable_answers_are_ambiguous(
    admin: EngineAdminClient,
) -> None:
    route = respx.post(f"{BASE}/load_lora_adapter")
    route.return_value = httpx.Response(500, json={"error": {"message": "boom"}})
    with pytest.raises(BackendAmbiguousError, match="HTTP 500: boom"):
        await admin.load_lora_adapter(NAME, PATH)
    route.return_value = httpx.Response(200, text="not json")
    with pytest.raises(BackendAmbiguousError, match="not a JSON object"):
        await admin.load_lora_adapter(NAME, PATH)
    route.return_value = httpx.Response(404, text="Not Found")
    with pytest.raises(BackendRefusedError, match="HTTP 404"):
        await admin.load_lora_adapter(NAME, PATH)


@pytest.mark.asyncio
@respx.mock
async def test_unload_outcomes(admin: EngineAdminClient) -> None:
    route = respx.post(f"{BASE}/unload_lora_adapter")
    route.return_value = httpx.Response(200, json=_lora_body(True))
    assert await admin.unload_lora_adapter(NAME) is UnloadOutcome.UNLOADED
    assert json.loads(route.calls.last.request.content) == {"lora_name": NAME}
    route.return_value = httpx.Response(
        400,
        json=_lora_body(
            False, f"LoRA with name {NAME} does not exist. Loaded LoRAs: odict_keys([])"
        ),
    )
    assert await admin.unload_lora_adapter(NAME) is UnloadOutcome.ABSENT
    route.return_value = httpx.Response(400, json=_lora_body(False, "rank 1 failed"))
    with pytest.raises(BackendRefusedError, match="rank 1 failed"):
        await admin.unload_lora_adapter(NAME)
    route.side_effect = httpx.ReadError("reset")
    with pytest.raises(BackendAmbiguousError):
        await admin.unload_lora_adapter(NAME)


@pytest.mark.asyncio
@respx.mock
async def test_models_lists_only_adapters(admin: EngineAdminClient) -> None:
    respx.get(f"{BASE}/v1/models").respond(
        200,
        json={
            "object": "list",
            "data": [
                {"id": "base", "root": "base", "parent": None},
                {"id": NAME, "root": PATH, "parent": "base"},
            ],
        },
    )
    assert await admin.list_lora_adapters() == {NAME: PATH}


@pytest.mark.asyncio
@respx.mock
async def test_probe_generates_one_greedy_token_through_the_exact_name(
    admin: EngineAdminClient,
) -> None:
    route = respx.post(f"{BASE}/generate").respond(
        200,
        json={
            "text": "a",
            "output_ids": [5],
            "meta_info": {"finish_reason": {"type": "length", "length": 1}},
        },
    )
    result = await admin.probe_generate(NAME)
    sent = json.loads(route.calls.last.request.content)
    assert sent["lora_path"] == NAME
    assert sent["sampling_params"] == {"max_new_tokens": 1, "temperature": 0.0}
    assert result.output_ids == (5,)
    assert result.finish_reason == "length"


@pytest.mark.asyncio
@respx.mock
async def test_probe_failures(admin: EngineAdminClient) -> None:
    route = respx.post(f"{BASE}/generate")
    route.return_value = httpx.Response(400, json={"error": {"message": "not loaded"}})
    with pytest.raises(BackendRefusedError, match="not loaded"):
        await admin.probe_generate(NAME)
    route.return_value = httpx.Response(
        200,
        json={
            "text": "",
            "output_ids": [],
            "meta_info": {"finish_reason": {"type": "abort", "message": "gone"}},
        },
    )
    with pytest.raises(BackendRefusedError, match="gone"):
        await admin.probe_generate(NAME)
    route.return_value = httpx.Response(
        200, json={"text": "", "output_ids": [], "meta_info": {"finish_reason": None}}
    )
    with pytest.raises(BackendAmbiguousError, match="no token"):
        await admin.probe_generate(NAME)


@pytest.mark.asyncio
@respx.mock
async def test_server_info_falls_back_to_the_old_path_and_fingerprints_the_process(
    admin: EngineAdminClient,
) -> None:
    info = {
        "version": "0.5.23",
        "model_path": "m",
        "random_seed": 7,
        "startup_time": {"scheduler_e2e": 3.25},
    }
    respx.get(f"{BASE}/server_info").respond(404, json={"detail": "Not Found"})
    old = respx.get(f"{BASE}/get_server_info").respond(
        200, json={**info, "internal_states": [{"x": 1}]}
    )
    first = await admin.server_info()
    assert old.called
    assert first.version == "0.5.23"
    # Live counters do not move the fingerprint; a new start (other seed/timings) does.
    assert server_fingerprint({**info, "internal_states": [{"x": 2}]}) == first.fingerprint
    assert (
        server_fingerprint({**info, "startup_time": {"scheduler_e2e": 3.26}}) != first.fingerprint
    )
    assert server_fingerprint({**info, "random_seed": 8}) != first.fingerprint


@pytest.mark.asyncio
async def test_a_shared_client_is_left_open() -> None:
    async with httpx.AsyncClient() as shared:
        admin = EngineAdminClient(BASE, client=shared)
        await admin.aclose()
        assert not shared.is_closed


def test_base_url_must_be_http() -> None:
    with pytest.raises(ValueError, match="http"):
        EngineAdminClient("127.0.0.1:30000")


@pytest.mark.asyncio
async def test_an_environment_proxy_is_never_used_to_reach_an_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    answer = {"version": "0.5.23", "model_path": "/m"}
    async with (
        direct_only(monkeypatch, answer) as (url, seen),
        EngineAdminClient(url, engine="e0") as client,
    ):
        info = await client.server_info()
    assert info.version == "0.5.23"
    assert len(seen) == 1
    assert seen[0].startswith(b"GET /server_info ")
