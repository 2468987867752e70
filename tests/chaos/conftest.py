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

import pytest
import pytest_asyncio
from agentic_lora_harness.engines import EngineFleet

from tests.chaos.support import chaos_seed
from tests.chaos.support import fleet_left_as_found
from tests.chaos.support import scenario_rng

#: The first test to ask for the fleet may pay for creating the engine venv and starting both
#: engines (minutes on a fresh machine); the ini timeout is for the test, not for that.
_FLEET_SETUP_TIMEOUT_SECONDS = 1800


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in item.path.parents:
            item.add_marker(pytest.mark.timeout(_FLEET_SETUP_TIMEOUT_SECONDS))


@pytest_asyncio.fixture
async def chaos_fleet(engine_fleet: EngineFleet) -> AsyncIterator[EngineFleet]:
    """The shared fleet; afterwards every engine runs and holds only what it held before."""
    async with fleet_left_as_found(engine_fleet):
        yield engine_fleet


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> random.Random:
    """This test's seeded choices (see tests.chaos.support.SEED_ENV)."""
    chaos_seed()
    return scenario_rng(request.node.name)
