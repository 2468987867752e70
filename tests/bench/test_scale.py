"""bench/scale.py as a smoke test: a small run on the instant engine reports every level and both
goals, and leaves no Session open (no speed is asserted here)."""

import pytest
from scale import run


@pytest.mark.asyncio
async def test_a_small_scale_run_reports_cpu_and_memory_for_every_level():
    report = await run([2, 8], turns=1, blocks=1)
    assert set(report["cpu_us_per_dispatch"]) == {2, 8}
    assert all(v > 0 for v in report["cpu_us_per_dispatch"].values())
    assert set(report["memory_bytes_per_session"]) == {2, 8}
    assert len(report["goals"]) == 2
    assert all(isinstance(g["holds"], bool) for g in report["goals"].values())
