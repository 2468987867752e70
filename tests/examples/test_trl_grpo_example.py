"""The TRL GRPO example (examples/trl_grpo) with the real ``GRPOTrainer``, on scripted engines.

What TRL really hands the rollout function and does with its answer: the prompts already
repeated ``num_generations`` times, one completion wanted per entry, the extra keys given to the
reward functions, the metrics in the trainer's log, the tokenization. The same example on real
engines, and what the engines served, is tests/e2e/test_trl_grpo.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from agentic_lora_grpo import PROMPTS
from agentic_lora_grpo import train
from agentic_lora_harness.fixture import Fixture
from agentic_lora_trl import encode_prompts

from agentic_lora.testing.fleet import ScriptedFleet
from agentic_lora.testing.scripted_engine import EngineOp
from tests.trl.support import TokenEngine
from tests.trl.support import bridge_on

pytestmark = [
    pytest.mark.slow,
    # TRL 1.16 still calls transformers' gradient-checkpointing names, deprecated in v5.
    pytest.mark.filterwarnings("ignore:.*is deprecated and will be removed in v6:FutureWarning"),
]

STEPS = 2
GENERATIONS = 2


def test_the_example_trains_on_session_rollouts_publishes_every_step_and_passes_its_checks(
    model_fixture: Fixture, tmp_path: Path
) -> None:
    with (
        ScriptedFleet(engine_type=TokenEngine) as fleet,
        bridge_on(fleet, tmp_path / "store", max_version_lag=1) as thread,
    ):
        report = train(
            thread,
            model_dir=model_fixture.model_dir,
            workdir=tmp_path,
            steps=STEPS,
            generations=GENERATIONS,
        )
        generations = [
            body
            for engine in fleet.engines.values()
            for body in engine.bodies(EngineOp.GENERATE)
            if body.get("return_logprob")
        ]
    assert report.problems() == []
    entries = len(PROMPTS) * GENERATIONS

    # TRL repeats every prompt num_generations times before it calls the rollout function, and
    # wants one trajectory per entry.
    assert [b.step for b in report.batches] == list(range(STEPS))
    for batch in report.batches:
        assert len(batch.prompts) == entries
        assert all(batch.prompts[i] == batch.prompts[i + 1] for i in range(0, entries, GENERATIONS))
        assert len(batch.trajectories()) == entries
    # Two model turns per trajectory, each one generation: nothing more reached the engines.
    assert len(generations) == STEPS * entries * 2
    assert all(t["agentic_lora"]["turns"] == 2 for t in report.trajectories())
    # The reward function got each completion's provenance, one value per completion.
    assert len(report.rewarded) == STEPS * entries
    assert [p for _, p in report.rewarded] == [t["agentic_lora"] for t in report.trajectories()]
    # Every step published, and the metrics reached the trainer's log.
    stats = report.stats
    assert (stats.published, stats.failed, stats.last_published_step) == (STEPS + 1, 0, STEPS)
    trainer = report.trainer
    logged = trainer.state.log_history[0]
    assert logged["agentic_lora/rollout_turns_mean"] == 2.0
    assert logged["agentic_lora/rollout_restarts"] == 0.0
    assert "agentic_lora/rollout_lag_max" in logged

    # The rollout tokenizes exactly as the trainer does for its own generation: conversational
    # prompts through the chat template with the generation prompt, and text prompts.
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    assert {tuple(b.trajectories()[0]["prompt_ids"]) for b in report.batches} <= {
        tuple(ids) for ids in encode_prompts(chats, trainer)
    }
    for prompts in (chats, list(PROMPTS)):
        assert encode_prompts(prompts, trainer) == trainer._tokenize_prompts(prompts)[0]
