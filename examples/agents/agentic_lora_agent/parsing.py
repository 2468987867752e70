"""Tool calls out of a chat completion, in the format Qwen models (and SGLang's parsers) use.

Two places can hold a call:

* ``message.tool_calls``: the engine already parsed them (SGLang started with
  ``--tool-call-parser``); the OpenAI shape ``{"id", "function": {"name", "arguments"}}``.
* ``message.content``: the raw model text, with each call as a block::

      <tool_call>
      {"name": "calculator", "arguments": {"expression": "17 * 23"}}
      </tool_call>

  ``arguments`` may be an object or a JSON string holding one.

Structured calls win when present. A block that cannot be read (bad JSON, no name, arguments
that are not an object, an opening tag without its closing tag) is reported in
:attr:`ParsedOutput.problems`, never guessed at; the agent may then sample the turn again.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agentic_lora_agent.tools import ToolCall

__all__ = ["CLOSE_TAG", "OPEN_TAG", "ParsedOutput", "format_tool_call", "parse_tool_calls"]

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN_TAG) + r"(.*?)" + re.escape(CLOSE_TAG), re.DOTALL)


@dataclass(frozen=True, slots=True)
class ParsedOutput:
    """The calls found, the text around them and what could not be read."""

    calls: tuple[ToolCall, ...]
    text: str
    problems: tuple[str, ...] = ()

    @property
    def malformed(self) -> bool:
        """The output tried to call a tool and at least one call could not be read."""
        return bool(self.problems)


def format_tool_call(name: str, arguments: Mapping[str, Any]) -> str:
    """The text block a Qwen model emits for one call (the inverse of parsing one block)."""
    payload = json.dumps({"name": name, "arguments": dict(arguments)}, ensure_ascii=False)
    return f"{OPEN_TAG}\n{payload}\n{CLOSE_TAG}"


def _arguments(raw: Any) -> Mapping[str, Any] | None:
    if isinstance(raw, str):
        try:
            raw = json.loads(raw) if raw.strip() else {}
        except ValueError:
            return None
    return raw if isinstance(raw, Mapping) else None


def _call(name: Any, raw_arguments: Any, call_id: str) -> ToolCall | str:
    if not isinstance(name, str) or not name.strip():
        return "a tool call without a name"
    arguments = _arguments(raw_arguments if raw_arguments is not None else {})
    if arguments is None:
        return f"arguments of {name!r} are not a JSON object"
    return ToolCall(name=name.strip(), arguments=dict(arguments), call_id=call_id)


def _structured(entries: Sequence[Any], turn: int) -> tuple[list[ToolCall], list[str]]:
    calls: list[ToolCall] = []
    problems: list[str] = []
    for i, entry in enumerate(entries):
        fn = entry.get("function") if isinstance(entry, Mapping) else None
        if not isinstance(fn, Mapping):
            problems.append(f"tool_calls[{i}] has no function")
            continue
        given_id = entry.get("id") if isinstance(entry, Mapping) else None
        call_id = given_id if isinstance(given_id, str) and given_id else f"call_{turn}_{i}"
        made = _call(fn.get("name"), fn.get("arguments"), call_id)
        if isinstance(made, str):
            problems.append(made)
        else:
            calls.append(made)
    return calls, problems


def _from_text(content: str, turn: int) -> tuple[list[ToolCall], list[str], str]:
    calls: list[ToolCall] = []
    problems: list[str] = []
    for i, match in enumerate(_BLOCK.finditer(content)):
        try:
            payload = json.loads(match.group(1))
        except json.JSONDecodeError as exc:
            problems.append(f"tool call {i} is not valid JSON ({exc.msg})")
            continue
        if not isinstance(payload, Mapping):
            problems.append(f"tool call {i} is not a JSON object")
            continue
        made = _call(payload.get("name"), payload.get("arguments"), f"call_{turn}_{i}")
        if isinstance(made, str):
            problems.append(made)
        else:
            calls.append(made)
    rest = _BLOCK.sub("", content)
    if OPEN_TAG in rest:
        # Typically a generation cut off by its token budget in the middle of a call.
        problems.append("a tool call is opened but never closed")
        rest = rest[: rest.index(OPEN_TAG)]
    return calls, problems, rest.strip()


def parse_tool_calls(message: Mapping[str, Any], *, turn: int = 0) -> ParsedOutput:
    """Read the calls of one assistant ``message`` (a chat completion's ``choices[0].message``).

    Call ids the engine did not give are ``call_<turn>_<index>``.
    """
    content = message.get("content")
    text = content if isinstance(content, str) else ""
    structured = message.get("tool_calls")
    if isinstance(structured, Sequence) and not isinstance(structured, str) and structured:
        calls, problems = _structured(structured, turn)
        return ParsedOutput(tuple(calls), text.strip(), tuple(problems))
    calls, problems, rest = _from_text(text, turn)
    return ParsedOutput(tuple(calls), rest, tuple(problems))
