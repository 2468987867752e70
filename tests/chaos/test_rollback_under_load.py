"""Chaos: a rollback in the middle of agent load, on real SGLang engines (see
``tests/chaos/rollback_scenario.py`` for the scenario and its verdicts): first to a RETIRED
version (still loaded, held by parked Sessions), then to a RECLAIMED one (loaded again). No
Session changes version, no request fails, Sessions bound after a rollback run the rolled-back
version and say where it came back from."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from agentic_lora_harness.engines import EngineFleet

from tests.chaos.rollback_scenario import rollback_under_load

pytestmark = [pytest.mark.engine, pytest.mark.slow]


@pytest.mark.asyncio
async def test_a_rollback_under_load_changes_no_sessions_version_and_fails_no_request(
    chaos_fleet: EngineFleet, tmp_path: Path, rng: random.Random
) -> None:
    report = await rollback_under_load(chaos_fleet, tmp_path, rng)
    print(report.summary(), f"\n  report: {report.write(tmp_path / 'report.json')}")
    assert report.problems == []
