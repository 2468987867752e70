"""Chaos: one engine of two hangs (SIGSTOP of its process group: it accepts TCP, answers nothing)
while agents run multi-turn Sessions and a trainer publishes, on real SGLang engines (see
``tests/chaos/hung_engine.py`` for the scenario and its verdicts).

The turn in flight on the hung engine ends ``REQUEST_INDETERMINATE`` at ``request_timeout``, the
Sessions go on on the other engine, no Session changes version; ``publish()`` commits over the
live member with the hung engine ``ENGINE_EJECTED`` instead of waiting for its 600 s load
timeout; a second publication, needing the slot of a version whose reclaim cannot finish on
the hung engine, is SKIPPED at once; after SIGCONT the engine rejoins only once the version
published meanwhile was loaded onto it, serves again, and the next publication commits."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from agentic_lora_harness.engines import EngineFleet

from tests.chaos.hung_engine import FAST_TIMING
from tests.chaos.hung_engine import hung_engine

pytestmark = [pytest.mark.engine, pytest.mark.slow]


@pytest.mark.asyncio
async def test_a_hung_engine_is_ejected_never_stalls_publish_and_rejoins_after_repair(
    chaos_fleet: EngineFleet, tmp_path: Path, rng: random.Random
) -> None:
    report = await hung_engine(chaos_fleet, tmp_path, rng, timing=FAST_TIMING)
    print(report.summary(), f"\n  report: {report.write(tmp_path / 'report.json')}")
    assert report.problems == []
