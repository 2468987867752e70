"""Chaos: engines added and drained under agent load, on real SGLang engines (see
``tests/chaos/membership_load.py`` for the scenario and its verdicts). The fleet starts with one
member; the second configured engine is added under load (every dispatchable version loaded onto
it, then ACTIVE, then serving new Sessions), then the first is drained under load (no request
starts on it, its Sessions go on on the other member, then it is REMOVED). A publication runs
during each change. No request fails, no Session changes version, and the refs are consistent at
the end."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from agentic_lora_harness.engines import EngineFleet

from tests.chaos.membership_load import membership_under_load

pytestmark = [pytest.mark.engine, pytest.mark.slow]


@pytest.mark.asyncio
async def test_an_engine_added_then_one_drained_under_load_fail_no_request_nor_move_a_session(
    chaos_fleet: EngineFleet, tmp_path: Path, rng: random.Random
) -> None:
    report = await membership_under_load(chaos_fleet, tmp_path, rng)
    print(report.summary(), f"\n  report: {report.write(tmp_path / 'report.json')}")
    assert report.problems == []
