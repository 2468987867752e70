"""TRL's GRPOTrainer trains a peft LoRA and publishes it through agentic-lora, on two real engines.

The TRL example (``examples/trl_grpo``, :func:`agentic_lora_grpo.train`) runs four optimizer
steps of ``GRPOTrainer`` on the fixture's tiny Qwen3 in float32 with a rank-8 LoRA on
q/k/v/o_proj: :class:`~agentic_lora_trl.SessionRollout` as its ``rollout_func`` (two prompts x two
generations, two model turns around a tool response per trajectory) and
:class:`~agentic_lora_trl.PublishCallback` publishing after every step, while the next step's
rollouts run (step 3 alone waits until step 2's weights committed, so that its rollouts run on a
trained version whatever the engines' speed). Every engine call goes through a
:class:`~tests.e2e.recording_proxy.RecordingProxy`, so the checks read what reached the engines:

1. **Training happened and every step was published.** Five versions (the starting weights and
   steps 1-4) were committed, each loaded on both engines under the digest of exactly that
   step's weights (copied by the test at the same trainer events), and the weights differ from
   step to step.
2. **One version per trajectory, on the wire.** Every request of a trajectory (``rid`` =
   ``<session id>-turn<n>``) named the same ``lora_path``: the version its provenance names.
   The tokens and logprobs TRL trained on are the ones the engine replied with.
3. **Fresh enough.** A trajectory whose batch started after version N was the default bound N
   or later, and no turn ran more than ``MAX_VERSION_LAG`` publications behind.
4. **The engines serve what the trainer trained.** For every model token of every trajectory,
   the engine's logprob under version N is compared with the trainer's own model carrying the
   step-N adapter on the same tokens (``log_softmax`` at temperature 1, as TRL computes it).

Tolerance, measured in this test. The engines run the fixture's bf16 weights; the trainer runs
them upcast to float32. The **float floor** is the same comparison for the trajectories generated
on the starting adapter (version 0: random, non-zero A and B, never trained, so only float error
separates the engine from the trainer). Every trajectory on version N must be within
``FLOOR_FACTOR`` x that floor (at least ``MIN_TOLERANCE``) of the step-N model on every token,
and, for every version, the same comparison against the step-(N-1) model must be at least
``SEPARATION`` times worse on average: the engine serves step N, not "some recent adapter".
Measured on this machine (three runs): the floor at most 0.004-0.010 nats per token (mean
0.0014-0.0016 over 96 tokens), step N at most 0.0025-0.004 (mean 0.0008-0.0009), step N-1
0.16-0.34 on average. bf16 keeps 8 significant bits (relative error up to 2^-9 per weight), which
on this model's logits of order 1 is a few thousandths of a nat: that is the floor. The tolerance
(0.02, or 3 x a larger floor) stays an order of magnitude below what one training step moves a
logprob. Each run logs its numbers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import statistics
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from agentic_lora_harness.engines import EngineFleet

from agentic_lora import AdapterSnapshot
from agentic_lora import load_settings
from tests.e2e.recording_proxy import RecordingProxy
from tests.e2e.recording_proxy import TrafficLog
from tests.e2e.recording_proxy import forbidden_exchanges
from tests.e2e.support import RegistryWatch
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
GENERATIONS = 2
MAX_VERSION_LAG = 1

#: A trajectory on version N matches the step-N model within FLOOR_FACTOR x the float floor ...
FLOOR_FACTOR = 3.0
#: ... or within this, if the floor of a run is smaller (a floor of a few tokens can be tiny).
MIN_TOLERANCE = 0.02
#: The step-(N-1) model is at least this many times further from the engine, on average.
SEPARATION = 3.0


@contextlib.asynccontextmanager
async def _proxies(fleet: EngineFleet, traffic: TrafficLog) -> AsyncIterator[dict[str, str]]:
    async with contextlib.AsyncExitStack() as stack:
        urls: dict[str, str] = {}
        for name, url in fleet.engines:
            proxy = await stack.enter_async_context(RecordingProxy(name, url, traffic))
            urls[name] = proxy.base_url
        yield urls


def _published_before(thread: Any, watch: RegistryWatch, step: int, version_id: str) -> Any:
    """A trainer callback that, on the trainer's thread, holds step ``step`` until
    ``version_id`` committed, so that step's rollouts run on a trained version however slow
    the engines are (the other steps' rollouts run while their predecessor publishes)."""
    from transformers import TrainerCallback

    class PublishedBefore(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step + 1 == step:
                thread.run(
                    watch.wait_for(
                        "commit",
                        lambda receipt: receipt.version_id == version_id,
                        what=f"{version_id} committed",
                    )
                )

    return PublishedBefore()


def _step_weights() -> Any:
    """A trainer callback keeping its own copy of the adapter at every event the publisher
    publishes at (train begin, every step end)."""
    from peft import get_peft_model_state_dict
    from transformers import TrainerCallback

    class StepWeights(TrainerCallback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.by_step: dict[int, dict[str, Any]] = {}

        def _take(self, model: Any, step: int) -> None:
            state = get_peft_model_state_dict(model)
            self.by_step[step] = {k: v.detach().clone() for k, v in state.items()}

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self._take(kw["model"], state.global_step)

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self._take(kw["model"], state.global_step)

    return StepWeights()


def _token_errors(model: Any, weights: dict[str, Any], trajectory: dict[str, Any]) -> list[float]:
    """|engine logprob - trainer logprob| over the trajectory's model tokens (env_mask 1), the
    trainer's model carrying ``weights``."""
    import torch
    from peft import set_peft_model_state_dict

    prompt, completion = trajectory["prompt_ids"], trajectory["completion_ids"]
    set_peft_model_state_dict(model, weights)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0].float()
    logps = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    ours = logps.gather(1, torch.tensor(completion)[:, None]).squeeze(1).tolist()
    return [
        abs(engine - trainer)
        for engine, trainer, mask in zip(
            trajectory["logprobs"], ours, trajectory["env_mask"], strict=True
        )
        if mask
    ]


@pytest.mark.asyncio
async def test_grpo_trains_publishes_every_step_and_the_engines_serve_what_it_trained(
    engines_restored: EngineFleet, tmp_path: Path
) -> None:
    from agentic_lora_grpo import PROMPTS
    from agentic_lora_grpo import train
    from agentic_lora_trl import DeploymentThread

    fleet = engines_restored
    traffic = TrafficLog()
    weights = _step_weights()
    prefix = fresh_id("grpo")
    async with _proxies(fleet, traffic) as urls:
        settings = load_settings(
            **fleet_config(urls, fleet.served_model_name),
            lora_name_prefix=prefix,
            max_version_lag=MAX_VERSION_LAG,
            probe_interval=3600.0,
        )
        thread = DeploymentThread.from_settings(
            settings, backend_options={"store_root": str(tmp_path / "adapter-store")}
        )
        # The trainer's thread (and the bridge's) run while this loop serves the proxies.
        await asyncio.to_thread(thread.start)
        try:
            watch = RegistryWatch(thread.deployment.registry)
            report = await asyncio.to_thread(
                train,
                thread,
                model_dir=fleet.fixture.model_dir,
                workdir=tmp_path,
                version_prefix=prefix,
                steps=STEPS,
                generations=GENERATIONS,
                callbacks=[weights, _published_before(thread, watch, 3, f"{prefix}-2")],
            )
        finally:
            await asyncio.to_thread(thread.close)
    assert report.problems() == []

    # 1. Trained for STEPS optimizer steps, and every step's weights became a version.
    trainer = report.trainer
    assert trainer.state.global_step == STEPS
    stats = report.stats
    assert (stats.published, stats.failed, stats.skipped) == (STEPS + 1, 0, 0)
    assert report.final_default == f"{prefix}-{STEPS}"
    config = trainer.model.peft_config["default"]
    digests = {
        step: AdapterSnapshot.from_state_dict(w, config).digest
        for step, w in weights.by_step.items()
    }
    assert sorted(digests) == list(range(STEPS + 1))
    assert len(set(digests.values())) == STEPS + 1  # training changed the weights every step
    loads = [e for e in traffic.exchanges if e.path == "/load_lora_adapter" and e.status == 200]
    for step, digest in digests.items():
        # The name the engines loaded carries the digest: exactly that step's weights.
        name_end = f"{prefix}-{step}-{digest[:16]}"
        assert {e.engine for e in loads if str(e.lora).endswith(name_end)} == set(fleet.names)

    # 2. One version per trajectory, on the wire; TRL trained on the engines' own tokens.
    trajectories = report.trajectories()
    assert len(trajectories) == STEPS * len(PROMPTS) * GENERATIONS
    generations = [e for e in traffic.exchanges if e.is_generation and e.field("return_logprob")]
    for trajectory in trajectories:
        provenance = trajectory["agentic_lora"]
        turns = [
            e
            for e in generations
            if str(e.field("rid")).startswith(f"{provenance['session_id']}-turn")
        ]
        assert len(turns) == provenance["turns"] == 2
        assert {e.lora for e in turns} == {provenance["lora_name"]}
        mask = trajectory["env_mask"]
        model_tokens = [t for t, m in zip(trajectory["completion_ids"], mask, strict=True) if m]
        model_logprobs = [p for p, m in zip(trajectory["logprobs"], mask, strict=True) if m]
        assert model_tokens == [t for e in turns for t in e.reply["output_ids"]]
        assert model_logprobs == [
            p[0] for e in turns for p in e.reply["meta_info"]["output_token_logprobs"]
        ]
        assert provenance["restarts"] == []

    # 3. A trajectory binds the default of when its batch started, or a later one, in the lag.
    for batch in report.batches:
        for trajectory in batch.trajectories():
            provenance = trajectory["agentic_lora"]
            assert provenance["default_revision_at_bind"] >= batch.revision_at_start
            assert all(lag is not None and lag <= MAX_VERSION_LAG for lag in provenance["lags"])

    # 4. The engines serve what the trainer trained.
    policy = trainer.model
    policy.eval()
    floor: list[float] = []
    per_version: dict[int, tuple[list[float], list[float]]] = {}
    for trajectory in trajectories:
        step = int(trajectory["agentic_lora"]["version_id"].removeprefix(f"{prefix}-"))
        errors = _token_errors(policy, weights.by_step[step], trajectory)
        if step == 0:
            floor.extend(errors)
            continue
        here, before = per_version.setdefault(step, ([], []))
        here.extend(errors)
        before.extend(_token_errors(policy, weights.by_step[step - 1], trajectory))
    assert floor, "no trajectory ran on the starting adapter"
    assert per_version, "no trajectory ran on a trained version"
    tolerance = max(FLOOR_FACTOR * max(floor), MIN_TOLERANCE)
    logger.warning(
        "float floor: max %.5f mean %.5f over %d tokens; tolerance %.5f; per version "
        "(max vs step N, mean vs step N, mean vs step N-1): %s",
        max(floor),
        statistics.fmean(floor),
        len(floor),
        tolerance,
        {
            step: (round(max(h), 5), round(statistics.fmean(h), 5), round(statistics.fmean(b), 5))
            for step, (h, b) in sorted(per_version.items())
        },
    )
    for step, (here, before) in per_version.items():
        assert max(here) <= tolerance, (step, max(here), tolerance)
        assert statistics.fmean(before) >= SEPARATION * statistics.fmean(here), step
    assert forbidden_exchanges(traffic.exchanges) == []
