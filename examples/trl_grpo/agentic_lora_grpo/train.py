"""GRPO with TRL through agentic-lora: the whole example on a running fleet.

:func:`train` runs ``GRPOTrainer`` on a small prompt set with

* :class:`~agentic_lora_trl.SessionRollout` as its ``rollout_func``: one Session per trajectory,
  two model turns around a tool response (:class:`ToolResponse`, environment tokens masked out);
* :class:`~agentic_lora_trl.PublishCallback`: the trained LoRA published as ``<prefix>-<step>``
  after every ``publish_every`` optimizer steps, off the training thread.

The reward function receives each completion's provenance (``agentic_lora``: version, digest,
lags, restarts) from the rollout, as TRL hands every extra rollout key to reward functions; the
example keeps it in the :class:`TrainReport`.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any

from agentic_lora_trl import DeploymentThread
from agentic_lora_trl import PublicationStats
from agentic_lora_trl import PublishCallback
from agentic_lora_trl import SessionRollout
from agentic_lora_trl import Turn

from agentic_lora import AgenticLoRASettings

__all__ = ["PROMPTS", "ToolResponse", "TrainReport", "train"]

#: The training prompts (conversational: TRL renders them with the chat template).
PROMPTS: tuple[str, ...] = (
    "What is the weather in the city?",
    "Please compute the sum of the list.",
)


class ToolResponse:
    """The environment: after the first model turn, a tool's answer; then the trajectory ends."""

    def __init__(self, tokenizer: Any, answer: str = "42") -> None:
        text = f"\n<tool_response>\n{answer}\n</tool_response>\n"
        self.tokens: list[int] = list(tokenizer(text, add_special_tokens=False)["input_ids"])

    async def __call__(self, turn: Turn) -> Sequence[int] | None:
        return self.tokens if turn.turn == 0 else None


@dataclass
class TrainReport:
    """What one run did: the publisher's counters and every trajectory's provenance."""

    steps: int
    version_prefix: str
    max_version_lag: int | None
    stats: PublicationStats = field(default_factory=PublicationStats)
    #: ``(trainer step, provenance)`` of every trajectory, in the order they were rewarded.
    trajectories: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    log_history: list[dict[str, Any]] = field(default_factory=list)

    def versions_used(self) -> Counter[str]:
        return Counter(str(p["version_id"]) for _, p in self.trajectories)

    def problems(self) -> list[str]:
        """Every check that failed (an empty list: all passed)."""
        problems: list[str] = []
        if self.stats.failed:
            problems.append(f"{self.stats.failed} publications failed")
        if self.stats.last_published_step != self.steps:
            problems.append(f"the last published step is {self.stats.last_published_step}")
        if not self.trajectories:
            problems.append("no trajectory was rewarded")
        for step, provenance in self.trajectories:
            if not str(provenance.get("version_id", "")).startswith(self.version_prefix):
                problems.append(f"step {step}: a trajectory ran on {provenance.get('version_id')}")
            lags = [lag for lag in provenance.get("lags", []) if lag is not None]
            if self.max_version_lag is not None and any(lag > self.max_version_lag for lag in lags):
                problems.append(f"step {step}: a turn ran {max(lags)} publications behind")
        return problems


def train(
    settings: AgenticLoRASettings,
    *,
    model_dir: Path,
    workdir: Path,
    steps: int = 4,
    publish_every: int = 1,
    learning_rate: float = 0.05,
    generations: int = 2,
    seed: int = 0,
) -> TrainReport:
    """Train for ``steps`` optimizer steps on the fleet ``settings`` describe; the adapter store
    (readable by the engines at the same path) and the trainer's output go under ``workdir``."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM
    from transformers import AutoTokenizer
    from trl.trainer.grpo_config import GRPOConfig
    from trl.trainer.grpo_trainer import GRPOTrainer

    prefix = f"grpo-{uuid.uuid4().hex[:8]}"
    report = TrainReport(
        steps=steps, version_prefix=prefix, max_version_lag=settings.max_version_lag
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def reward(
        completion_ids: list[list[int]],
        agentic_lora: list[dict[str, Any]],
        trainer_state: Any,
        **kwargs: Any,
    ) -> list[float | None]:
        # A toy reward (the fixture model is random): any reward that differs within a group
        # gives GRPO a gradient. The provenance arrives with every completion.
        report.trajectories.extend((trainer_state.global_step, p) for p in agentic_lora)
        return [1.0 - sum(ids) / (len(ids) * float(tokenizer.vocab_size)) for ids in completion_ids]

    store = workdir / "adapter-store"
    with DeploymentThread.from_settings(
        settings, backend_options={"store_root": str(store)}
    ) as thread:
        publish = PublishCallback(thread, publish_every=publish_every, version_prefix=prefix)
        torch.manual_seed(seed)
        trainer = GRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
            reward_funcs=reward,
            args=GRPOConfig(
                output_dir=str(workdir / "trainer"),
                per_device_train_batch_size=len(PROMPTS) * generations,
                num_generations=generations,
                max_completion_length=24,
                max_steps=steps,
                learning_rate=learning_rate,
                lr_scheduler_type="constant",
                logging_steps=1,
                report_to="none",
                use_cpu=True,
                save_strategy="no",
                gradient_checkpointing=False,
                disable_tqdm=True,
                seed=seed,
            ),
            train_dataset=Dataset.from_dict(
                {"prompt": [[{"role": "user", "content": p}] for p in PROMPTS]}
            ),
            processing_class=tokenizer,
            peft_config=LoraConfig(
                r=8,
                lora_alpha=16,
                target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                task_type="CAUSAL_LM",
            ),
            rollout_func=SessionRollout(
                thread, environment=ToolResponse(tokenizer), max_turns=2, max_turn_tokens=8
            ),
            callbacks=[publish],
        )
        trainer.train()
        report.stats = publish.stats
        report.log_history = list(trainer.state.log_history)
    return report
