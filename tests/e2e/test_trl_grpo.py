"""TRL's GRPOTrainer trains a peft LoRA and publishes it through agentic-lora, on two real engines.

The trainer (the fixture's tiny Qwen3 in float32, a rank-8 LoRA on q/k/v/o_proj) runs four
optimizer steps of ``GRPOTrainer`` with :class:`~agentic_lora_trl.SessionRollout` as its
``rollout_func`` (two prompts x two generations, two model turns around a tool response per
trajectory) and :class:`~agentic_lora_trl.PublishCallback` publishing after every step, while the
next step's rollouts run. Every engine call goes through a
:class:`~tests.e2e.recording_proxy.RecordingProxy`, so the checks read what reached the engines:

1. **Training happened and every step was published.** Five versions (the starting weights and
   steps 1-4) were committed, each with the digest of exactly that step's weights (copied by
   the test at the same trainer event), and the weights differ from step to step.
2. **One version per trajectory, on the wire.** Every request of a trajectory (``rid`` =
   ``<session id>-turn<n>``) named the same ``lora_path``: the version its provenance names.
   The tokens and logprobs TRL trained on are the ones the engine replied with.
3. **Fresh enough.** A trajectory whose batch started after version N was the default bound N
   or later, and no turn ran more than ``MAX_VERSION_LAG`` publications behind.
4. **The engines serve what the trainer trained.** For every model token of every trajectory,
   the engine's logprob under version N is compared with the trainer's own model carrying the
   step-N adapter on the same tokens (``log_softmax`` at temperature 1, as TRL computes it).

Tolerance, measured in this test. The engines run the fixture's bf16 weights; the trainer runs
them upcast to float32. The **float floor** is the same comparison for trajectories generated on
the starting adapter (version 0, never trained, so nothing but float error can separate the
engine from the trainer). Every trajectory on version N must be within
``FLOOR_FACTOR`` x that floor (at least ``MIN_TOLERANCE``) of the step-N model, and the same
comparison against the step-(N-1) model must be at least ``SEPARATION`` times worse on average:
the engine serves step N, not "some recent adapter". The numbers of a run are logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import statistics
from collections.abc import AsyncIterator
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from agentic_lora_harness.engines import EngineFleet

from agentic_lora import AdapterSnapshot
from agentic_lora import load_settings
from tests.e2e.recording_proxy import RecordingProxy
from tests.e2e.recording_proxy import TrafficLog
from tests.e2e.recording_proxy import forbidden_exchanges
from tests.e2e.support import fleet_config
from tests.e2e.support import fresh_id

pytestmark = [
    pytest.mark.engine,
    pytest.mark.slow,
    # TRL 1.16 still calls transformers' gradient-checkpointing names, deprecated in v5.
    pytest.mark.filterwarnings("ignore:.*is deprecated and will be removed in v6:FutureWarning"),
]

logger = logging.getLogger(__name__)

STEPS = 4
PROMPTS = ("What is the weather in the city?", "Please compute the sum of the list.")
GENERATIONS = 2
MAX_COMPLETION = 20
TURN_TOKENS = 6
MAX_VERSION_LAG = 1
#: The tool's answer between the two model turns (environment tokens: env_mask 0).
TOOL_RESPONSE = "\n<tool_response>\n42\n</tool_response>\n"

#: A trajectory on version N matches the step-N model within FLOOR_FACTOR x the float floor ...
FLOOR_FACTOR = 3.0
#: ... or within this, if the floor of a run is smaller (a floor of a few tokens can be tiny).
MIN_TOLERANCE = 0.02
#: The step-(N-1) model is at least this many times further from the engine, on average.
SEPARATION = 3.0


@dataclass(frozen=True)
class Batch:
    """One call of the rollout function: what was the default when it started, what it made."""

    step: int
    revision_at_start: int
    default_at_start: str | None
    output: dict[str, Any]


@contextlib.asynccontextmanager
async def _proxies(fleet: EngineFleet, traffic: TrafficLog) -> AsyncIterator[dict[str, str]]:
    async with contextlib.AsyncExitStack() as stack:
        urls: dict[str, str] = {}
        for name, url in fleet.engines:
            proxy = await stack.enter_async_context(RecordingProxy(name, url, traffic))
            urls[name] = proxy.base_url
        yield urls


def _logprobs_under(
    model: Any, weights: dict[str, Any], prompt: list[int], completion: list[int]
) -> list[float]:
    """The trainer model's logprob of each completion token with ``weights`` loaded."""
    import torch
    from peft import set_peft_model_state_dict

    set_peft_model_state_dict(model, weights)
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    logps = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return logps.gather(1, torch.tensor(completion)[:, None]).squeeze(1).tolist()


def _model_token_errors(
    model: Any, weights: dict[str, Any], trajectory: dict[str, Any]
) -> list[float]:
    """|engine logprob - trainer logprob| over the trajectory's model tokens (env_mask 1)."""
    ours = _logprobs_under(model, weights, trajectory["prompt_ids"], trajectory["completion_ids"])
    return [
        abs(engine - trainer)
        for engine, trainer, mask in zip(
            trajectory["logprobs"], ours, trajectory["env_mask"], strict=True
        )
        if mask
    ]


def _trajectories(batches: Sequence[Batch]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for batch in batches:
        keys = ("prompt_ids", "completion_ids", "logprobs", "env_mask", "agentic_lora")
        for values in zip(*(batch.output[k] for k in keys), strict=True):
            out.append({**dict(zip(keys, values, strict=True)), "batch": batch})
    return out


@pytest.mark.asyncio
async def test_grpo_trains_publishes_every_step_and_the_engines_serve_what_it_trained(
    engines_restored: EngineFleet, tmp_path: Path
) -> None:
    import torch
    from agentic_lora_trl import DeploymentThread
    from agentic_lora_trl import PublishCallback
    from agentic_lora_trl import SessionRollout
    from agentic_lora_trl import Turn
    from datasets import Dataset
    from peft import LoraConfig
    from peft import get_peft_model_state_dict
    from transformers import AutoModelForCausalLM
    from transformers import AutoTokenizer
    from transformers import TrainerCallback
    from trl import GRPOConfig
    from trl import GRPOTrainer

    fleet = engines_restored
    traffic = TrafficLog()
    tokenizer = AutoTokenizer.from_pretrained(fleet.fixture.model_dir)
    tool_tokens = tokenizer(TOOL_RESPONSE, add_special_tokens=False)["input_ids"]
    prefix = fresh_id("grpo")

    async def tool(turn: Turn) -> list[int] | None:
        return tool_tokens if turn.turn == 0 else None

    class StepWeights(TrainerCallback):  # type: ignore[misc]
        """The test's own copy of each step's adapter, taken at the callback's moments."""

        def __init__(self) -> None:
            self.by_step: dict[int, dict[str, torch.Tensor]] = {}

        def _take(self, model: Any, step: int) -> None:
            state = get_peft_model_state_dict(model)
            self.by_step[step] = {k: v.detach().clone() for k, v in state.items()}

        def on_train_begin(
            self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any
        ) -> None:
            self._take(model, state.global_step)

        def on_step_end(
            self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any
        ) -> None:
            self._take(model, state.global_step)

    def reward(completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
        # Varies within every group (random sampling), so every step has a gradient.
        assert len(kwargs["agentic_lora_version"]) == len(completion_ids)
        return [sum(ids) / (len(ids) * 2048.0) for ids in completion_ids]

    async with _proxies(fleet, traffic) as urls:
        settings = load_settings(
            **fleet_config(urls, fleet.served_model_name),
            lora_name_prefix=prefix,
            max_version_lag=MAX_VERSION_LAG,
            probe_interval=3600.0,
        )
        thread = DeploymentThread.from_settings(
            settings, backend_options={"store_root": str(tmp_path / "store")}
        )
        await asyncio.to_thread(thread.start)
        try:
            rollout = SessionRollout(
                thread, environment=tool, max_turns=2, max_turn_tokens=TURN_TOKENS
            )
            batches: list[Batch] = []

            def recorded_rollout(prompts: list[Any], trainer: Any) -> dict[str, Any]:
                status = thread.run(thread.deployment.status())
                output = rollout(prompts, trainer)
                batches.append(
                    Batch(
                        trainer.state.global_step,
                        status.default_revision,
                        status.default_version,
                        output,
                    )
                )
                return output

            publish = PublishCallback(thread, publish_every=1, version_prefix=prefix)
            weights = StepWeights()
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_pretrained(
                fleet.fixture.model_dir, dtype=torch.float32
            )
            trainer = GRPOTrainer(
                model=model,
                reward_funcs=reward,
                args=GRPOConfig(
                    output_dir=str(tmp_path / "out"),
                    per_device_train_batch_size=len(PROMPTS) * GENERATIONS,
                    num_generations=GENERATIONS,
                    max_completion_length=MAX_COMPLETION,
                    max_steps=STEPS,
                    learning_rate=0.05,
                    lr_scheduler_type="constant",
                    temperature=1.0,
                    logging_steps=1,
                    report_to="none",
                    use_cpu=True,
                    save_strategy="no",
                    gradient_checkpointing=False,
                    seed=0,
                    disable_tqdm=True,
                ),
                train_dataset=Dataset.from_dict(
                    {"prompt": [[{"role": "user", "content": p}] for p in PROMPTS]}
                ),
                processing_class=tokenizer,
                peft_config=LoraConfig(
                    r=8,
                    lora_alpha=16,
                    target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                    init_lora_weights=False,
                    task_type="CAUSAL_LM",
                ),
                rollout_func=recorded_rollout,
                callbacks=[publish, weights],
            )
            await asyncio.to_thread(trainer.train)
            status = await asyncio.to_thread(thread.run, thread.deployment.status())
        finally:
            await asyncio.to_thread(thread.close)

    # 1. Trained for STEPS optimizer steps, and every step's weights became a version.
    assert trainer.state.global_step == STEPS
    stats = publish.stats
    assert (stats.published, stats.failed, stats.skipped) == (STEPS + 1, 0, 0)
    assert status.default_version == f"{prefix}-{STEPS}"
    config = trainer.model.peft_config["default"]
    digests = {
        step: AdapterSnapshot.from_state_dict(w, config).digest
        for step, w in weights.by_step.items()
    }
    assert sorted(digests) == list(range(STEPS + 1))
    assert len(set(digests.values())) == STEPS + 1  # training changed the weights every step
    loads = [e for e in traffic.exchanges if e.path == "/load_lora_adapter" and e.status == 200]
    for step, digest in digests.items():
        # The name engines loaded carries the digest: exactly the step's weights reached them.
        name_part = f"{prefix}-{step}-{digest[:16]}"
        assert {e.engine for e in loads if e.lora and e.lora.endswith(name_part)} == set(
            fleet.names
        )

    # 2. One version per trajectory, on the wire; TRL trained on the engines' own tokens.
    trajectories = _trajectories(batches)
    assert len(trajectories) == STEPS * len(PROMPTS) * GENERATIONS
    generations = [e for e in traffic.exchanges if e.is_generation and e.field("return_logprob")]
    for trajectory in trajectories:
        provenance = trajectory["agentic_lora"]
        session = provenance["session_id"]
        turns = [e for e in generations if str(e.field("rid")).startswith(f"{session}-turn")]
        assert len(turns) == provenance["turns"] == 2
        assert {e.lora for e in turns} == {provenance["lora_name"]}
        engine_ids = [t for e in turns for t in e.reply["output_ids"]]
        engine_logprobs = [
            p[0] for e in turns for p in e.reply["meta_info"]["output_token_logprobs"]
        ]
        model_tokens = [
            t
            for t, m in zip(trajectory["completion_ids"], trajectory["env_mask"], strict=True)
            if m
        ]
        model_logprobs = [
            p for p, m in zip(trajectory["logprobs"], trajectory["env_mask"], strict=True) if m
        ]
        assert model_tokens == engine_ids
        assert model_logprobs == engine_logprobs
        assert provenance["restarts"] == []

    # 3. A trajectory binds the default of when its batch started, or a later one, within the lag.
    for trajectory in trajectories:
        provenance = trajectory["agentic_lora"]
        assert provenance["default_revision_at_bind"] >= trajectory["batch"].revision_at_start
        assert all(lag is not None and lag <= MAX_VERSION_LAG for lag in provenance["lags"])

    # 4. The engines serve what the trainer trained.
    policy = trainer.model
    policy.eval()
    by_version = {f"{prefix}-{step}": step for step in weights.by_step}
    floor: list[float] = []
    here: list[float] = []
    previous: list[float] = []
    per_version: dict[int, tuple[float, float]] = {}
    for trajectory in trajectories:
        step = by_version[trajectory["agentic_lora"]["version_id"]]
        errors = _model_token_errors(policy, weights.by_step[step], trajectory)
        if step == 0:
            floor.extend(errors)
            continue
        before = _model_token_errors(policy, weights.by_step[step - 1], trajectory)
        here.extend(errors)
        previous.extend(before)
        per_version[step] = (max(errors), statistics.fmean(before))
    assert floor, "no trajectory ran on the starting adapter"
    assert here, "no trajectory ran on a trained version"
    tolerance = max(FLOOR_FACTOR * max(floor), MIN_TOLERANCE)
    logger.warning(
        "float floor max %.5f mean %.5f; step N max %.5f mean %.5f; step N-1 mean %.5f; "
        "tolerance %.5f; per version %s",
        max(floor),
        statistics.fmean(floor),
        max(here),
        statistics.fmean(here),
        statistics.fmean(previous),
        tolerance,
        per_version,
    )
    assert max(here) <= tolerance
    assert statistics.fmean(previous) >= SEPARATION * statistics.fmean(here)
    assert forbidden_exchanges(traffic.exchanges) == []
