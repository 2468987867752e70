"""The rollout hook: one Session per trajectory, token ids and logprobs, env masks, staleness."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from agentic_lora_trl import DeploymentThread
from agentic_lora_trl import GenerationPlan
from agentic_lora_trl import RolloutTooStaleError
from agentic_lora_trl import SessionRollout
from agentic_lora_trl import Trajectory
from agentic_lora_trl import Turn
from agentic_lora_trl.rollout import rollout_output
from agentic_lora_trl.tokens import token_turn

from agentic_lora.errors import DispatchError
from agentic_lora.errors import RequestRefusedError
from agentic_lora.testing.adapters import tiny_snapshot
from agentic_lora.testing.fleet import ScriptedFleet
from agentic_lora.testing.scripted_engine import EngineOp
from agentic_lora.testing.scripted_engine import Fault
from agentic_lora.testing.scripted_engine import FaultKind
from tests.trl.support import TURN_LENGTH
from tests.trl.support import bridge_on
from tests.trl.support import registry_of
from tests.trl.support import turn_logprob
from tests.trl.support import turn_tokens

PLAN = GenerationPlan(
    sampling={"temperature": 1.0, "top_p": 1.0, "top_k": -1},
    max_completion_length=16,
    stop_token_ids=(2,),
    label="t",
)


def _publish(thread: DeploymentThread, version_id: str, seed: int) -> str:
    result = thread.run(thread.deployment.publish(version_id, tiny_snapshot(seed)))
    assert result.ok
    assert result.lora_name is not None
    return result.lora_name


def _generations(fleet: ScriptedFleet) -> list[dict[str, Any]]:
    """The rollout's generations that reached the engines (not the backend's load probes), by
    ``rid`` (``<session id>-turn<n>``: trajectory, attempt and turn order, whichever engine)."""
    bodies = [
        body
        for engine in fleet.engines.values()
        for body in engine.bodies(EngineOp.GENERATE)
        if body.get("return_logprob")
    ]
    return sorted(bodies, key=lambda body: str(body["rid"]))


def _run(
    thread: DeploymentThread,
    rollout: SessionRollout,
    prompt_ids: Sequence[Sequence[int]],
    plan: GenerationPlan = PLAN,
) -> list[Trajectory]:
    prompts = [f"prompt {i}" for i in range(len(prompt_ids))]
    return thread.run(rollout.generate(prompts, prompt_ids, plan))


class ToolTurns:
    """An environment answering each model turn with tool tokens, ``rounds`` times."""

    def __init__(self, rounds: int, tokens: Sequence[int] = (7, 8)) -> None:
        self.rounds = rounds
        self.tokens = list(tokens)
        self.seen: list[Turn] = []

    async def __call__(self, turn: Turn) -> Sequence[int] | None:
        self.seen.append(turn)
        return self.tokens if turn.turn < self.rounds else None


def test_a_multi_turn_trajectory_masks_tool_tokens_and_keeps_the_engines_tokens_and_logprobs(
    bridge: DeploymentThread, fleet: ScriptedFleet
) -> None:
    lora = _publish(bridge, "v1", 1)
    tools = ToolTurns(rounds=1)
    rollout = SessionRollout(bridge, environment=tools, max_turns=3)
    prompt = [11, 12, 13, 14]
    [trajectory] = _run(bridge, rollout, [prompt])

    first = turn_tokens(len(prompt))
    second = turn_tokens(len(prompt) + TURN_LENGTH + 2)
    assert trajectory.prompt_ids == prompt
    assert trajectory.completion_ids == [*first, 7, 8, *second]
    assert trajectory.env_mask == [1, 1, 1, 0, 0, 1, 1, 1]
    model_logprobs = [turn_logprob(i) for i in range(TURN_LENGTH)]
    assert trajectory.logprobs == [*model_logprobs, 0.0, 0.0, *model_logprobs]
    # The environment saw the model turn it answers, and stopped the trajectory after turn 2.
    assert [(t.turn, t.output_ids, t.finish_reason) for t in tools.seen] == [
        (0, tuple(first), "length"),
        (1, tuple(second), "length"),
    ]
    # What reached the engines: every turn on token ids, with logprobs, on the one version,
    # the second turn continuing exactly the first turn's tokens and the tool's.
    bodies = _generations(fleet)
    assert [b["input_ids"] for b in bodies] == [prompt, [*prompt, *first, 7, 8]]
    assert {b["lora_path"] for b in bodies} == {lora}
    assert [b["sampling_params"]["max_new_tokens"] for b in bodies] == [16, 16 - 5]
    assert all(b["sampling_params"]["stop_token_ids"] == [2] for b in bodies)
    provenance = trajectory.provenance
    assert (provenance["version_id"], provenance["turns"], provenance["lags"]) == ("v1", 2, [0, 0])
    assert provenance["restarts"] == []
    assert provenance["lora_name"] == lora
    # Each request names its trajectory's Session and its turn (engine logs, abort by id).
    session = provenance["session_id"]
    assert [b["rid"] for b in bodies] == [f"{session}-turn0", f"{session}-turn1"]


def test_max_turn_tokens_bounds_each_model_turn_within_the_completion_budget(
    bridge: DeploymentThread, fleet: ScriptedFleet
) -> None:
    _publish(bridge, "v1", 1)
    rollout = SessionRollout(
        bridge, environment=ToolTurns(rounds=3), max_turns=4, max_turn_tokens=2
    )
    plan = GenerationPlan(sampling={}, max_completion_length=9)
    [trajectory] = _run(bridge, rollout, [[1]], plan)
    # turns of 2 model tokens, tools of 2 tokens, until the budget of 9 is reached.
    assert [b["sampling_params"]["max_new_tokens"] for b in _generations(fleet)] == [2, 2, 1]
    assert trajectory.env_mask == [1, 1, 0, 0, 1, 1, 0, 0, 1]


def test_one_trajectory_per_entry_each_in_its_own_session_in_the_prompts_order(
    bridge: DeploymentThread, fleet: ScriptedFleet
) -> None:
    _publish(bridge, "v1", 1)
    rollout = SessionRollout(bridge, max_concurrency=2)
    prompts = [[1] * n for n in (3, 3, 5, 5, 7)]  # a prompt repeated per generation, as TRL sends
    trajectories = _run(bridge, rollout, prompts)
    assert [t.prompt_ids for t in trajectories] == prompts
    assert [t.completion_ids for t in trajectories] == [turn_tokens(len(p)) for p in prompts]
    sessions = {t.provenance["session_id"] for t in trajectories}
    assert len(sessions) == len(prompts)
    assert len(_generations(fleet)) == len(prompts)
    assert bridge.deployment.versioning.live_sessions() == ()
    assert registry_of(bridge).peek_version("v1").session_refs == 0  # type: ignore[union-attr]


def test_the_completion_budget_cuts_environment_tokens_and_ends_the_trajectory(
    bridge: DeploymentThread,
) -> None:
    _publish(bridge, "v1", 1)
    tools = ToolTurns(rounds=5, tokens=[9] * 20)
    rollout = SessionRollout(bridge, environment=tools, max_turns=5)
    plan = GenerationPlan(sampling={}, max_completion_length=8)
    [trajectory] = _run(bridge, rollout, [[1, 2]], plan)
    assert len(trajectory.completion_ids) == 8
    assert trajectory.env_mask == [1, 1, 1, 0, 0, 0, 0, 0]
    assert trajectory.completion_ids[3:] == [9] * 5


def test_a_trajectory_refused_as_too_stale_restarts_from_its_prompt_on_the_new_default(
    fleet: ScriptedFleet, tmp_path: Path
) -> None:
    thread = bridge_on(fleet, tmp_path, max_version_lag=0)
    try:
        old = _publish(thread, "v1", 1)
        new_lora: list[str] = []

        async def publish_during_first_attempt(turn: Turn) -> Sequence[int] | None:
            # The trainer publishes while the trajectory waits for its tool: the next turn of
            # this Session is one publication behind, more than max_version_lag=0 allows.
            if not new_lora:
                result = await thread.deployment.publish("v2", tiny_snapshot(2))
                assert result.lora_name is not None
                new_lora.append(result.lora_name)
            return [7, 8] if turn.turn == 0 else None

        rollout = SessionRollout(thread, environment=publish_during_first_attempt, max_turns=2)
        prompt = [5, 6, 7]
        [trajectory] = _run(thread, rollout, [prompt])
    finally:
        thread.close()

    first = turn_tokens(len(prompt))
    # Only the restarted attempt's tokens are kept; it ran both turns on v2.
    assert trajectory.completion_ids == [*first, 7, 8, *turn_tokens(len(prompt) + 5)]
    provenance = trajectory.provenance
    assert provenance["version_id"] == "v2"
    assert provenance["lags"] == [0, 0]
    assert provenance["restarts"] == [
        {"version_id": "v1", "digest": tiny_snapshot(1).digest, "lag": 1, "turns": 1}
    ]
    # On the wire: the refused attempt's one turn on v1, then the restart's two turns on v2.
    # The refused turn never reached an engine, and nothing continued on another version.
    bodies = _generations(fleet)
    assert [(b["lora_path"], b["input_ids"]) for b in bodies] == [
        (old, prompt),
        (new_lora[0], prompt),
        (new_lora[0], [*prompt, *first, 7, 8]),
    ]


def test_too_many_restarts_raise_and_every_session_of_the_batch_is_closed(
    fleet: ScriptedFleet, tmp_path: Path
) -> None:
    thread = bridge_on(fleet, tmp_path, max_version_lag=0, capacity=4)
    try:
        _publish(thread, "v1", 1)
        published = [1]

        async def always_publish(turn: Turn) -> Sequence[int] | None:
            # Every attempt of trajectory 0 sees a publication before its second turn.
            if turn.index == 0:
                published.append(published[-1] + 1)
                result = await thread.deployment.publish(
                    f"v{published[-1]}", tiny_snapshot(published[-1])
                )
                assert result.ok
            return [7]

        rollout = SessionRollout(thread, environment=always_publish, max_turns=2, max_restarts=1)
        with pytest.raises(RolloutTooStaleError) as raised:
            _run(thread, rollout, [[1, 2], [3, 4]])
        assert raised.value.code == "TRL_ROLLOUT_TOO_STALE"
        assert raised.value.details["prompt_index"] == 0
        assert [r["version_id"] for r in raised.value.details["restarts"]] == ["v1", "v2"]
        assert thread.deployment.versioning.live_sessions() == ()
        status = thread.run(thread.deployment.status())
        assert all(v.session_refs == 0 for v in status.versions)
    finally:
        thread.close()


def test_a_refused_turn_is_raised_as_classified_and_never_sent_again(
    bridge: DeploymentThread, fleet: ScriptedFleet
) -> None:
    _publish(bridge, "v1", 1)
    for engine in fleet.engines.values():
        engine.script(EngineOp.GENERATE, Fault(FaultKind.REFUSE, "bad sampling value"))
    rollout = SessionRollout(bridge)
    with pytest.raises(RequestRefusedError):
        _run(bridge, rollout, [[1, 2]])
    assert len(_generations(fleet)) == 1
    assert bridge.deployment.versioning.live_sessions() == ()


def test_rollout_output_has_one_value_per_trajectory_for_trl_and_the_reward_functions() -> None:
    provenance = {"version_id": "v3", "digest": "ab" * 32, "lags": [0, 2, None], "turns": 3}
    trajectory = Trajectory([1], [2, 3], [-0.5, 0.0], [1, 0], {**provenance, "restarts": []})
    output = rollout_output([trajectory, trajectory])
    assert output["prompt_ids"] == [[1], [1]]
    assert output["completion_ids"] == [[2, 3], [2, 3]]
    assert output["logprobs"] == [[-0.5, 0.0], [-0.5, 0.0]]
    assert output["env_mask"] == [[1, 0], [1, 0]]
    assert output["agentic_lora_version"] == ["v3", "v3"]
    assert output["agentic_lora_digest"] == ["ab" * 32] * 2
    assert output["agentic_lora_lag"] == [2, 2]
    assert output["agentic_lora"][0]["turns"] == 3


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({"output_ids": [5], "meta_info": {}}, "reply_without_logprobs"),
        ("text", "reply_without_logprobs"),
        (
            {"output_ids": [5, 6], "meta_info": {"output_token_logprobs": [[-1.0, 5, None]]}},
            "logprob_token_mismatch",
        ),
        (
            {"output_ids": [5], "meta_info": {"output_token_logprobs": [[-1.0, 9, None]]}},
            "logprob_token_mismatch",
        ),
        (
            {"output_ids": [5], "meta_info": {"output_token_logprobs": [[None, 5, None]]}},
            "logprob_token_mismatch",
        ),
    ],
)
def test_a_reply_without_matching_logprobs_is_refused(body: object, reason: str) -> None:
    with pytest.raises(DispatchError) as refused:
        token_turn(body)
    assert refused.value.details["reason"] == reason


def test_a_reply_is_read_as_the_engines_tokens_and_logprobs() -> None:
    turn = token_turn(
        {
            "output_ids": [5, 2],
            "meta_info": {
                "output_token_logprobs": [[-1.5, 5, None], [-0.25, 2, None]],
                "finish_reason": {"type": "stop", "matched": 2},
            },
        }
    )
    assert (turn.output_ids, turn.logprobs, turn.finish_reason) == ((5, 2), (-1.5, -0.25), "stop")
