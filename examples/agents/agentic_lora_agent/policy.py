"""Tasks, and the fallback policy that picks a tool when the model's output has none.

With the tiny random test model every generation is noise, so no output ever holds a parsable tool
call. To still exercise multi-turn tool use on real engines, a :class:`ScriptedPolicy` then supplies
the call: it is keyed only on the task and the turn index (``task.plan[turn]``), so a run is
reproducible. It is a *fallback*: whenever the model emits a parsable call, that call is used and
the policy is not consulted. With a real model run without a policy (``policy=None``): an output
without a tool call is then the final answer.

Plan arguments may name earlier observations as ``{0}``, ``{1}``, ... (in the order the tools
returned them), so a later calculator step computes with what a lookup actually returned.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field
from typing import Protocol

from agentic_lora_agent.tools import ToolCall

__all__ = ["FallbackPolicy", "PlanStep", "ScriptedPolicy", "Task"]


@dataclass(frozen=True)
class PlanStep:
    """One tool call of a task's scripted plan (argument values may hold ``{i}`` placeholders)."""

    tool: str
    arguments: Mapping[str, str]


@dataclass(frozen=True)
class Task:
    """What an episode is asked to do.

    ``plan`` feeds the :class:`ScriptedPolicy`; ``turn_max_tokens`` overrides the token budget of
    single turns (e.g. one long reasoning turn); ``expected_answer`` is what the last tool
    observation must be when the plan ran as written (a check on the tools, not on the model).
    """

    task_id: str
    prompt: str
    plan: tuple[PlanStep, ...] = ()
    turn_max_tokens: Mapping[int, int] = field(default_factory=dict)
    expected_answer: str | None = None

    def max_tokens(self, turn: int, default: int) -> int:
        """The token budget of ``turn``."""
        return self.turn_max_tokens.get(turn, default)


class FallbackPolicy(Protocol):
    """Chooses a tool call for a turn whose output had none (None: answer now)."""

    def next_call(self, task: Task, turn: int, observations: Sequence[str]) -> ToolCall | None:
        """The call for ``turn`` of ``task``, given the observations so far."""
        ...


def _fill(template: str, observations: Sequence[str]) -> str:
    try:
        return template.format(*observations)
    except (IndexError, KeyError, ValueError):
        # A placeholder with no observation behind it: sent as written, the tool reports it.
        return template


class ScriptedPolicy:
    """The deterministic fallback: ``task.plan[turn]`` with placeholders filled, then answer."""

    def next_call(self, task: Task, turn: int, observations: Sequence[str]) -> ToolCall | None:
        """See :class:`FallbackPolicy`; ``None`` once the plan is exhausted."""
        if turn >= len(task.plan):
            return None
        step = task.plan[turn]
        arguments = {k: _fill(v, observations) for k, v in step.arguments.items()}
        return ToolCall(
            name=step.tool, arguments=arguments, call_id=f"call_{turn}_0", source="policy"
        )
