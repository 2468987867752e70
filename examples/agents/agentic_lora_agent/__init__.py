"""A tool-using agent that runs its episodes through agentic-lora Sessions.

See ``examples/agents/README.md`` for running it on real engines with a real model.
"""

from agentic_lora_agent.agent import DEFAULT_SYSTEM_PROMPT
from agentic_lora_agent.agent import AgentConfig
from agentic_lora_agent.agent import AgentObserver
from agentic_lora_agent.agent import ToolAgent
from agentic_lora_agent.parsing import ParsedOutput
from agentic_lora_agent.parsing import format_tool_call
from agentic_lora_agent.parsing import parse_tool_calls
from agentic_lora_agent.policy import FallbackPolicy
from agentic_lora_agent.policy import PlanStep
from agentic_lora_agent.policy import ScriptedPolicy
from agentic_lora_agent.policy import Task
from agentic_lora_agent.records import AttemptKind
from agentic_lora_agent.records import AttemptOutcome
from agentic_lora_agent.records import AttemptRecord
from agentic_lora_agent.records import Episode
from agentic_lora_agent.records import EpisodeStatus
from agentic_lora_agent.records import TurnRecord
from agentic_lora_agent.stats import Percentiles
from agentic_lora_agent.stats import episode_json
from agentic_lora_agent.stats import episode_line
from agentic_lora_agent.stats import percentiles
from agentic_lora_agent.tasks import REFERENCE_TABLE
from agentic_lora_agent.tasks import TASKS
from agentic_lora_agent.tasks import default_toolbox
from agentic_lora_agent.tasks import filler_document
from agentic_lora_agent.tasks import task_for
from agentic_lora_agent.tools import Calculator
from agentic_lora_agent.tools import Lookup
from agentic_lora_agent.tools import Tool
from agentic_lora_agent.tools import ToolBox
from agentic_lora_agent.tools import ToolCall
from agentic_lora_agent.tools import ToolError
from agentic_lora_agent.tools import ToolResult

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
