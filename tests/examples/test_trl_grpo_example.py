"""The TRL GRPO example (examples/trl_grpo) on scripted engines: it trains, publishes and checks.

The example on real engines is what ``python -m agentic_lora_grpo`` runs; the integration on
real engines is tests/e2e/test_trl_grpo.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from agentic_lora_grpo import PROMPTS
from agentic_lora_grpo import train
from agentic_lora_harness.fixture import Fixture

from agentic_lora.testing.fleet import ScriptedFleet
from tests.trl.support import TokenEngine

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:.*is deprecated and will be removed in v6:FutureWarning"),
]


def test_the_example_trains_publishes_every_step_and_passes_its_checks(
    model_fixture: Fixture, tmp_path: Path
) -> None:
    with ScriptedFleet(engine_type=TokenEngine) as fleet:
        report = train(
            fleet.settings(max_version_lag=1),
            model_dir=model_fixture.model_dir,
            workdir=tmp_path,
            steps=2,
        )
    assert report.problems() == []
    assert report.stats.published == 3
    assert len(report.trajectories) == 2 * len(PROMPTS) * 2
    assert all(p["turns"] == 2 for _, p in report.trajectories)
    assert sum(report.versions_used().values()) == len(report.trajectories)
