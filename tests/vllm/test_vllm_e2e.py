"""Publication, binding and reclaim end to end on two real vLLM engines.

The real registry, publisher, reclaimer and vLLM backend run against the real engines. Sessions
are driven at the registry (``bind_first`` / ``begin_close`` / ``release``) and their requests
carry the bound name as ``model``, because the Session middleware's OpenAI pin writes
``<base>:<lora_name>``, which vLLM does not resolve (pinned in ``test_vllm_behaviour.py``). The
per-adapter request count that the middleware will own is kept here by :class:`AdapterRequests`
and handed to the backend as its drain hook.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from agentic_lora_harness.vllm_engines import VllmFleet
from agentic_lora_vllm import VllmBackend

from agentic_lora.adapter import AdapterSnapshot
from agentic_lora.backends import EngineRef
from agentic_lora.publisher import PublicationOutcome, Publisher
from agentic_lora.reclaimer import Reclaimer
from agentic_lora.registry.local import LocalRegistry
from agentic_lora.registry.types import Binding, VersionState, new_request_id

pytestmark = [pytest.mark.engine, pytest.mark.vllm, pytest.mark.slow]


class AdapterRequests:
    """Requests in flight per adapter name; ``wait_drained`` returns when a name has none."""

    def __init__(self) -> None:
        self._count: Counter[str] = Counter()
        self._changed = asyncio.Condition()
        self.waited: list[str] = []

    async def send(
        self, http: httpx.AsyncClient, base_url: str, lora_name: str, prompt: str
    ) -> str:
        async with self._changed:
            self._count[lora_name] += 1
        try:
            reply = await http.post(
                f"{base_url}/v1/completions",
                json={"model": lora_name, "prompt": prompt, "max_tokens": 8, "temperature": 0.0},
            )
        finally:
            async with self._changed:
                self._count[lora_name] -= 1
                self._changed.notify_all()
        reply.raise_for_status()
        assert reply.json()["model"] == lora_name
        return str(reply.json()["choices"][0]["text"])

    async def wait_drained(self, lora_name: str) -> None:
        self.waited.append(lora_name)
        async with self._changed:
            await self._changed.wait_for(lambda: self._count[lora_name] == 0)


@pytest_asyncio.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=5.0)) as http:
        yield http


async def listed(http: httpx.AsyncClient, base: str) -> set[str]:
    cards = (await http.get(f"{base}/v1/models")).raise_for_status().json()["data"]
    return {c["id"] for c in cards if c.get("parent") is not None}


@pytest.mark.asyncio
async def test_old_sessions_keep_a_new_sessions_get_b_and_a_is_reclaimed_after_release(
    vllm_fleet: VllmFleet, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    fixture = vllm_fleet.fixture
    engines = [EngineRef(name, url) for name, url in vllm_fleet.engines]
    urls = dict(vllm_fleet.engines)
    registry = LocalRegistry(engines=vllm_fleet.names, capacity=2, prefix="e2e_vllm")
    requests = AdapterRequests()
    backend = VllmBackend(tmp_path / "store", wait_drained=requests.wait_drained)
    publisher = Publisher(registry, backend, engines)
    reclaimer = Reclaimer(registry, backend, engines)

    async def bind(session: str) -> Binding:
        return await registry.bind_first(request_id=new_request_id(), session_key=session)

    async def generate(binding: Binding, engine: str, turn: int) -> str:
        return await requests.send(client, urls[engine], binding.lora_name, f"turn {turn}: def")

    names: list[str] = []
    try:
        published_a = await publisher.publish(
            "e2e-a", AdapterSnapshot.from_peft_dir(fixture.adapter("A"))
        )
        assert published_a.outcome is PublicationOutcome.PUBLISHED
        assert published_a.lora_name is not None
        names.append(published_a.lora_name)
        old = await bind("old-episode")
        assert old.lora_name == published_a.lora_name
        old_turns = [await generate(old, engine, 1) for engine in vllm_fleet.names]
        assert old_turns[0] == old_turns[1]  # both engines serve the same version

        published_b = await publisher.publish(
            "e2e-b", AdapterSnapshot.from_peft_dir(fixture.adapter("B"))
        )
        assert published_b.outcome is PublicationOutcome.PUBLISHED
        assert published_b.lora_name is not None
        names.append(published_b.lora_name)

        # The old Session keeps A on every engine and every later turn; a new one gets B.
        assert await bind("old-episode") == old
        for engine in vllm_fleet.names:
            assert await generate(old, engine, 1) == old_turns[0]
        new = await bind("new-episode")
        assert new.lora_name == published_b.lora_name
        new_turn = await generate(new, "E1", 1)
        assert new_turn != old_turns[0]

        # A is retired but bound: a reclaim round leaves it loaded.
        await reclaimer.reclaim_once()
        for url in urls.values():
            assert published_a.lora_name in await listed(client, url)
        assert requests.waited == []

        await registry.begin_close(request_id=new_request_id(), session_key="old-episode")
        await registry.release(request_id=new_request_id(), session_key="old-episode")
        report = await reclaimer.reclaim_once()
        assert report.reclaimed == ("e2e-a",)
        assert requests.waited == [published_a.lora_name] * len(engines)

        status = await registry.status()
        states = {v.version_id: v.state for v in status.versions}
        assert states == {"e2e-a": VersionState.RECLAIMED, "e2e-b": VersionState.PUBLISHED}
        assert status.slots_in_use == 1
        for url in urls.values():
            assert await listed(client, url) >= {published_b.lora_name}
            assert published_a.lora_name not in await listed(client, url)
            late = await client.post(
                f"{url}/v1/completions", json={"model": published_a.lora_name, "prompt": "x"}
            )
            assert late.status_code == 404
        assert not (tmp_path / "store" / "E0" / published_a.lora_name).exists()
        assert await generate(new, "E1", 1) == new_turn  # B is untouched
    finally:
        # Leave the session-wide fleet as it was found.
        for url in urls.values():
            for name in names:
                await client.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": name})
        await backend.aclose()
        await registry.aclose()
