"""The reference table the lookup tool serves and a few tasks whose plans use both tools.

Every task's ``expected_answer`` is what the last tool observation is when its plan runs: the
calculator working on what the lookups returned. It checks the tools and the plumbing of
observations into later turns, not the model.
"""

from __future__ import annotations

import random
from collections.abc import Mapping

from agentic_lora_agent.policy import PlanStep, Task
from agentic_lora_agent.tools import Calculator, Lookup, ToolBox

__all__ = ["REFERENCE_TABLE", "TASKS", "default_toolbox", "filler_document", "task", "task_for"]

REFERENCE_TABLE: Mapping[str, str] = {
    "population of oslo": "709037",
    "population of bergen": "291940",
    "capital of norway": "Oslo",
    "capital of japan": "Tokyo",
    "boiling point of water in celsius": "100",
    "speed of light in km/s": "299792",
    "days in a leap year": "366",
    "height of mount everest in m": "8849",
}


def _step(tool: str, **arguments: str) -> PlanStep:
    return PlanStep(tool, arguments)


TASKS: Mapping[str, Task] = {
    t.task_id: t
    for t in (
        Task(
            "oslo-plus",
            "What is 17 * 23 plus the population of Oslo?",
            plan=(
                _step("calculator", expression="17 * 23"),
                _step("lookup", key="population of oslo"),
                _step("calculator", expression="{0} + {1}"),
            ),
            expected_answer=str(17 * 23 + 709037),
        ),
        Task(
            "fahrenheit",
            "What is the boiling point of water in Fahrenheit?",
            plan=(
                _step("lookup", key="boiling point of water in celsius"),
                _step("calculator", expression="{0} * 9 / 5 + 32"),
            ),
            expected_answer="212",
        ),
        Task(
            "light-minute",
            "How many kilometres does light travel in one minute?",
            plan=(
                _step("lookup", key="speed of light in km/s"),
                _step("calculator", expression="{0} * 60"),
            ),
            expected_answer=str(299792 * 60),
        ),
        Task(
            "two-cities",
            "How many people live in Oslo and Bergen together?",
            plan=(
                _step("lookup", key="population of oslo"),
                _step("lookup", key="population of bergen"),
                _step("calculator", expression="{0} + {1}"),
            ),
            expected_answer=str(709037 + 291940),
        ),
        Task(
            "everest-days",
            "What is the height of Mount Everest in metres divided by the days in a leap year?",
            plan=(
                _step("lookup", key="height of mount everest in m"),
                _step("lookup", key="days in a leap year"),
                _step("calculator", expression="{0} // {1}"),
            ),
            expected_answer=str(8849 // 366),
        ),
    )
}


def task(task_id: str) -> Task:
    """The built-in task ``task_id`` (KeyError naming the known ones)."""
    try:
        return TASKS[task_id]
    except KeyError:
        raise KeyError(f"no task {task_id!r}; known: {sorted(TASKS)}") from None


def task_for(agent: int, episode: int) -> Task:
    """The built-in tasks in turn, offset per agent: what agent ``agent`` runs as ``episode``.

    Concurrent agents of a load thereby run different tasks at the same time.
    """
    tasks = tuple(TASKS.values())
    return tasks[(agent + episode) % len(tasks)]


def filler_document(words: int, *, seed: int = 7) -> str:
    """``words`` pseudo-random common words: a tool observation of a chosen size, reproducibly."""
    vocabulary = ("the", "engine", "adapter", "version", "session", "request", "token", "model")
    rng = random.Random(seed)
    return " ".join(rng.choice(vocabulary) for _ in range(words))


def default_toolbox(extra_entries: Mapping[str, str] | None = None) -> ToolBox:
    """A calculator and a lookup over :data:`REFERENCE_TABLE` plus ``extra_entries``."""
    table = {**REFERENCE_TABLE, **(extra_entries or {})}
    return ToolBox([Calculator().tool(), Lookup(table).tool()])
