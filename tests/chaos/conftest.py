"""Fixtures of the chaos suite: the shared engine fleet (left as it was found) and seeded choices.

The fleet is the test session's shared two-engine fleet (``engine_fleet`` from
tests/conftest.py). A chaos test may kill and restart an engine of it; on the way out
:func:`chaos_fleet` makes sure every engine runs again, unloads every adapter the test left on
an engine, and checks that each engine lists nothing it did not list before (an engine that was
restarted lists less: it lost what it had).
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from agentic_lora_harness.engines import EngineFleet

from tests.chaos.support import chaos_seed, scenario_rng

#: The first test to ask for the fleet may pay for creating the engine venv and starting both
#: engines (minutes on a fresh machine); the ini timeout is for the test, not for that.
_FLEET_SETUP_TIMEOUT_SECONDS = 1800


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in item.path.parents:
            item.add_marker(pytest.mark.timeout(_FLEET_SETUP_TIMEOUT_SECONDS))


async def _adapters(client: httpx.AsyncClient, base_url: str) -> set[str]:
    response = await client.get(f"{base_url}/v1/models")
    assert response.status_code == 200, response.text
    return {card["id"] for card in response.json()["data"] if card.get("parent") is not None}


@pytest_asyncio.fixture
async def chaos_fleet(engine_fleet: EngineFleet) -> AsyncIterator[EngineFleet]:
    """The shared fleet; afterwards every engine runs and holds only what it held before."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=10.0)) as client:
        before = {name: await _adapters(client, url) for name, url in engine_fleet.engines}
        yield engine_fleet
        for name in engine_fleet.names:
            if engine_fleet.pid(name) is None:  # a test that failed between kill and restart
                await engine_fleet.arestart(name)
        for name, url in engine_fleet.engines:
            for leftover in sorted(await _adapters(client, url) - before[name]):
                response = await client.post(
                    f"{url}/unload_lora_adapter", json={"lora_name": leftover}
                )
                assert response.json()["success"] is True, response.text
        for name, url in engine_fleet.engines:
            assert await _adapters(client, url) <= before[name], name


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> random.Random:
    """This test's seeded choices (see tests.chaos.support.SEED_ENV)."""
    chaos_seed()
    return scenario_rng(request.node.name)
