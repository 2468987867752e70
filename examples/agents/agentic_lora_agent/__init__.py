"""A tool-using agent that runs its episodes through agentic-lora Sessions.

See ``examples/agents/README.md`` for running it on real engines with a real model.
"""

from agentic_lora_agent.agent import DEFAULT_SYSTEM_PROMPT, AgentConfig, AgentObserver, ToolAgent
from agentic_lora_agent.parsing import ParsedOutput, format_tool_call, parse_tool_calls
from agentic_lora_agent.policy import FallbackPolicy, PlanStep, ScriptedPolicy, Task
from agentic_lora_agent.records import (
    AttemptKind,
    AttemptOutcome,
    AttemptRecord,
    Episode,
    EpisodeStatus,
    TurnRecord,
)
from agentic_lora_agent.stats import Percentiles, episode_json, episode_line, percentiles
from agentic_lora_agent.tasks import (
    REFERENCE_TABLE,
    TASKS,
    default_toolbox,
    filler_document,
    task_for,
)
from agentic_lora_agent.tools import (
    Calculator,
    Lookup,
    Tool,
    ToolBox,
    ToolCall,
    ToolError,
    ToolResult,
)

__all__ = [
    "DEFAULT_SYSTEM_PROMPT",
    "REFERENCE_TABLE",
    "TASKS",
    "AgentConfig",
    "AgentObserver",
    "AttemptKind",
    "AttemptOutcome",
    "AttemptRecord",
    "Calculator",
    "Episode",
    "EpisodeStatus",
    "FallbackPolicy",
    "Lookup",
    "ParsedOutput",
    "Percentiles",
    "PlanStep",
    "ScriptedPolicy",
    "Task",
    "Tool",
    "ToolAgent",
    "ToolBox",
    "ToolCall",
    "ToolError",
    "ToolResult",
    "TurnRecord",
    "default_toolbox",
    "episode_json",
    "episode_line",
    "filler_document",
    "format_tool_call",
    "parse_tool_calls",
    "percentiles",
    "task_for",
]
