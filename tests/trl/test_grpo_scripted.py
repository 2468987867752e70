"""The real ``GRPOTrainer`` with the rollout and the publish callback, on scripted engines.

What TRL really hands the rollout function and does with its answer: the prompts already
repeated ``num_generations`` times, one completion wanted per entry, the extra keys given to the
reward functions, the metrics in the trainer's log. (The real-engine test, in ``tests/e2e``,
checks what the engines served.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from agentic_lora_harness.fixture import Fixture
from agentic_lora_trl import DeploymentThread
from agentic_lora_trl import PublishCallback
from agentic_lora_trl import SessionRollout
from agentic_lora_trl import encode_prompts
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM
from transformers import AutoTokenizer
from trl import GRPOConfig
from trl import GRPOTrainer

from agentic_lora.testing.fleet import ScriptedFleet
from agentic_lora.testing.scripted_engine import EngineOp

pytestmark = [
    pytest.mark.slow,
    # TRL 1.16 still calls transformers' gradient-checkpointing names, deprecated in v5.
    pytest.mark.filterwarnings("ignore:.*is deprecated and will be removed in v6:FutureWarning"),
]

PROMPTS = ("the agent calls a tool", "hello world please", "compute the sum")
GENERATIONS = 2
STEPS = 2


def test_grpo_trainer_trains_on_session_rollouts_and_publishes_each_step(
    bridge: DeploymentThread, fleet: ScriptedFleet, model_fixture: Fixture, tmp_path: Path
) -> None:
    rollout = SessionRollout(bridge)
    seen: list[list[Any]] = []

    def recording(prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        seen.append(list(prompts))
        return rollout(prompts, trainer)

    rewarded: list[dict[str, Any]] = []

    def reward(completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
        rewarded.append(kwargs)
        return [float(i) for i in range(len(completion_ids))]

    publish = PublishCallback(bridge, version_prefix="scripted")
    tokenizer = AutoTokenizer.from_pretrained(model_fixture.model_dir)
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_fixture.model_dir, dtype=torch.float32),
        reward_funcs=reward,
        args=GRPOConfig(
            output_dir=str(tmp_path / "out"),
            per_device_train_batch_size=len(PROMPTS) * GENERATIONS,
            num_generations=GENERATIONS,
            max_completion_length=8,
            max_steps=STEPS,
            logging_steps=1,
            report_to="none",
            use_cpu=True,
            save_strategy="no",
            gradient_checkpointing=False,
            disable_tqdm=True,
            seed=0,
        ),
        train_dataset=Dataset.from_dict({"prompt": list(PROMPTS)}),
        processing_class=tokenizer,
        peft_config=LoraConfig(
            r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"
        ),
        rollout_func=recording,
        callbacks=[publish],
    )
    trainer.train()

    # TRL repeats every prompt num_generations times before calling the rollout function.
    assert len(seen) == STEPS
    for prompts in seen:
        assert len(prompts) == len(PROMPTS) * GENERATIONS
        assert sorted(prompts) == sorted(list(PROMPTS) * GENERATIONS)
        assert all(prompts[i] == prompts[i + 1] for i in range(0, len(prompts), GENERATIONS))
    # One Session, one generation per entry: nothing more reached the engines.
    generations = [
        body
        for engine in fleet.engines.values()
        for body in engine.bodies(EngineOp.GENERATE)
        if body.get("return_logprob")
    ]
    assert len(generations) == STEPS * len(PROMPTS) * GENERATIONS
    encoded = [tokenizer(text=p)["input_ids"] for p in PROMPTS]
    assert sorted({tuple(b["input_ids"]) for b in generations}) == sorted(map(tuple, encoded))
    # The reward functions got each completion's provenance, one value per completion.
    assert len(rewarded) == STEPS
    for kwargs in rewarded:
        assert len(kwargs["agentic_lora_version"]) == len(PROMPTS) * GENERATIONS
        assert all(
            v is not None and v.startswith("scripted-") for v in kwargs["agentic_lora_version"]
        )
        assert len(kwargs["agentic_lora"]) == len(PROMPTS) * GENERATIONS
        assert "env_mask" not in kwargs
    # Every step published; the metrics reached the trainer's log.
    stats = publish.stats
    assert (stats.published, stats.failed, stats.last_published_step) == (STEPS + 1, 0, STEPS)
    assert bridge.run(bridge.deployment.status()).default_version == f"scripted-{STEPS}"
    logged = trainer.state.log_history[0]
    assert logged["agentic_lora/rollout_lag_max"] == 0.0
    assert logged["agentic_lora/rollout_turns_mean"] == 1.0
    assert logged["agentic_lora/rollout_restarts"] == 0.0

    # The rollout tokenizes exactly as the trainer does for its own generation: text prompts,
    # and conversational ones through the chat template with the generation prompt.
    texts = list(PROMPTS)
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    for prompts in (texts, chats):
        assert encode_prompts(prompts, trainer) == trainer._tokenize_prompts(prompts)[0]
