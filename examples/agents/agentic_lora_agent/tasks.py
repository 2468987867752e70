"""The reference table the lookup tool serves and a few tasks whose plans use both tools.

Both are read from ``tasks.json`` in this package.

Every task's ``expected_answer`` is what the last tool observation is when its plan runs: the
calculator working on what the lookups returned. It checks the tools and the plumbing of
observations into later turns, not the model.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pydantic import TypeAdapter

from agentic_lora_agent.policy import Task
from agentic_lora_agent.tools import Calculator
from agentic_lora_agent.tools import Lookup
from agentic_lora_agent.tools import ToolBox

__all__ = ["REFERENCE_TABLE", "TASKS", "default_toolbox", "filler_document", "task", "task_for"]


@dataclass(frozen=True)
class _Catalogue:
    reference_table: Mapping[str, str]
    tasks: tuple[Task, ...]


# The catalogue is data (tasks.json next to this module): the ids, prompts, plans and expected
# answers; pydantic turns it into the frozen Task / PlanStep records and rejects a malformed entry.
_CATALOGUE = TypeAdapter(_Catalogue).validate_json(
    Path(__file__).with_name("tasks.json").read_bytes()
)

REFERENCE_TABLE: Mapping[str, str] = _CATALOGUE.reference_table
TASKS: Mapping[str, Task] = {t.task_id: t for t in _CATALOGUE.tasks}


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
