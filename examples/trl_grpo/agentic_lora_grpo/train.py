"""GRPO with TRL through agentic-lora: the whole example on a running fleet.

:func:`train` runs ``GRPOTrainer`` on a small prompt set, through the Deployment of a running
:class:`~agentic_lora_trl.DeploymentThread`, with

* :class:`~agentic_lora_trl.SessionRollout` as its ``rollout_func``: one Session per trajectory,
  two model turns around a tool response (:class:`ToolResponse`, environment tokens masked out);
* :class:`~agentic_lora_trl.PublishCallback`: the trained LoRA published as ``<prefix>-<step>``
  after every ``publish_every`` optimizer steps, off the training thread.

The reward function receives each completion's provenance (``agentic_lora``: version, digest,
lags, restarts) from the rollout, as TRL hands every extra rollout key to reward functions. The
:class:`TrainReport` keeps what each rollout batch returned and the default revision when it
started, so its checks (and the tests) can say which version every trajectory ran on.
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

__all__ = ["PROMPTS", "RolloutBatch", "ToolResponse", "TrainReport", "train"]

#: The training prompts (conversational: TRL renders them with the chat template).
PROMPTS: tuple[str, ...] = (
    "What is the weather in the city?",
    "Please compute the sum of the list.",
)

#: What one trajectory is, in the rollout's output (one list per key, one entry per trajectory).
TRAJECTORY_KEYS = ("prompt_ids", "completion_ids", "logprobs", "env_mask", "agentic_lora")


class ToolResponse:
    """The environment: after the first model turn, a tool's answer; then the trajectory ends."""

    def __init__(self, tokenizer: Any, answer: str = "42") -> None:
        text = f"\n<tool_response>\n{answer}\n</tool_response>\n"
        self.tokens: list[int] = list(tokenizer(text, add_special_tokens=False)["input_ids"])

    async def __call__(self, turn: Turn) -> Sequence[int] | None:
        return self.tokens if turn.turn == 0 else None


@dataclass(frozen=True)
class RolloutBatch:
    """One call of the rollout function."""

    #: The trainer's step when the batch was asked for.
    step: int
    #: The registry's default revision (and version) just before the batch started.
    revision_at_start: int
    default_at_start: str | None
    #: What TRL passed (each prompt ``num_generations`` times) and what the rollout returned.
    prompts: list[Any]
    output: dict[str, list[Any]]

    def trajectories(self) -> list[dict[str, Any]]:
        """One dict per trajectory: its :data:`TRAJECTORY_KEYS`."""
        columns = [self.output[key] for key in TRAJECTORY_KEYS]
        return [dict(zip(TRAJECTORY_KEYS, row, strict=True)) for row in zip(*columns, strict=True)]


@dataclass
class TrainReport:
    """What one run did."""

    steps: int
    version_prefix: str
    max_version_lag: int | None
    stats: PublicationStats = field(default_factory=PublicationStats)
    batches: list[RolloutBatch] = field(default_factory=list)
    #: ``(trainer step, provenance)`` as each completion reached the reward function.
    rewarded: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    #: The registry's default version when training ended.
    final_default: str | None = None
    #: The trainer, after training (its model, state and log history).
    trainer: Any = None

    def trajectories(self) -> list[dict[str, Any]]:
        return [t for batch in self.batches for t in batch.trajectories()]

    def versions_used(self) -> Counter[str]:
        return Counter(str(t["agentic_lora"]["version_id"]) for t in self.trajectories())

    def problems(self) -> list[str]:
        """Every check that failed (an empty list: all passed)."""
        problems: list[str] = []
        stats = self.stats
        if stats.failed:
            problems.append(f"{stats.failed} publications failed")
        final = f"{self.version_prefix}-{self.steps}"
        if stats.last_published_step != self.steps or self.final_default != final:
            problems.append(f"the final weights are not the default ({self.final_default})")
        if not self.batches:
            problems.append("no rollout ran")
        if len(self.rewarded) != len(self.trajectories()):
            problems.append("a completion reached the reward function without its provenance")
        for batch in self.batches:
            for trajectory in batch.trajectories():
                provenance = trajectory["agentic_lora"]
                if not str(provenance["version_id"]).startswith(self.version_prefix):
                    problems.append(f"step {batch.step}: ran on {provenance['version_id']}")
                if provenance["default_revision_at_bind"] < batch.revision_at_start:
                    problems.append(f"step {batch.step}: bound a version older than the default")
                lags = [lag for lag in provenance["lags"] if lag is not None]
                bound = self.max_version_lag
                if bound is not None and any(lag > bound for lag in lags):
                    problems.append(f"step {batch.step}: a turn ran {max(lags)} versions behind")
        return problems


def train(
    thread: DeploymentThread,
    *,
    model_dir: Path,
    workdir: Path,
    version_prefix: str | None = None,
    steps: int = 4,
    publish_every: int = 1,
    learning_rate: float = 0.05,
    generations: int = 2,
    max_completion_length: int = 20,
    max_turn_tokens: int = 6,
    seed: int = 0,
    callbacks: Sequence[Any] = (),
) -> TrainReport:
    """Train for ``steps`` optimizer steps, generating and publishing through ``thread``.

    Versions are ``<version_prefix>-<step>`` (default: a fresh ``grpo-<random>``); the trainer's
    output goes under ``workdir``. ``callbacks`` are more ``TrainerCallback``s, run after the
    publisher's.
    """
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM
    from transformers import AutoTokenizer
    from trl.trainer.grpo_config import GRPOConfig
    from trl.trainer.grpo_trainer import GRPOTrainer

    prefix = version_prefix or f"grpo-{uuid.uuid4().hex[:8]}"
    max_lag = thread.deployment.settings.max_version_lag
    report = TrainReport(steps=steps, version_prefix=prefix, max_version_lag=max_lag)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def reward(
        completion_ids: list[list[int]],
        agentic_lora: list[dict[str, Any]],
        trainer_state: Any,
        **kwargs: Any,
    ) -> list[float | None]:
        # A toy reward (the fixture model is random): any reward that differs within a group
        # gives GRPO a gradient. The provenance arrives with every completion.
        report.rewarded.extend((trainer_state.global_step, p) for p in agentic_lora)
        return [1.0 - sum(ids) / (len(ids) * float(tokenizer.vocab_size)) for ids in completion_ids]

    rollout = SessionRollout(
        thread, environment=ToolResponse(tokenizer), max_turns=2, max_turn_tokens=max_turn_tokens
    )

    def recorded_rollout(prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        status = thread.run(thread.deployment.status())
        output = rollout(prompts, trainer)
        report.batches.append(
            RolloutBatch(
                step=trainer.state.global_step,
                revision_at_start=status.default_revision,
                default_at_start=status.default_version,
                prompts=list(prompts),
                output=output,
            )
        )
        return output

    publish = PublishCallback(thread, publish_every=publish_every, version_prefix=prefix)
    torch.manual_seed(seed)
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        reward_funcs=reward,
        args=GRPOConfig(
            output_dir=str(workdir / "trainer"),
            per_device_train_batch_size=len(PROMPTS) * generations,
            num_generations=generations,
            max_completion_length=max_completion_length,
            max_steps=steps,
            learning_rate=learning_rate,
            lr_scheduler_type="constant",
            temperature=1.0,
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
            # Random A and B: the starting adapter already changes the model, so the tests can
            # compare the engines with the trainer on a non-trivial adapter from step 0.
            init_lora_weights=False,
            task_type="CAUSAL_LM",
        ),
        rollout_func=recorded_rollout,
        callbacks=[publish, *callbacks],
    )
    trainer.train()
    report.stats = publish.stats
    report.final_default = thread.run(thread.deployment.status()).default_version
    report.trainer = trainer
    return report
