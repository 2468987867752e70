"""The agent's tools: a calculator and a lookup over a small in-memory table.

A tool never raises into the agent loop: :meth:`ToolBox.run` turns every failure (unknown tool,
bad arguments, an expression it refuses) into an observation that starts with ``error:``, which
is what a model is shown, so it can correct itself on the next turn.
"""

from __future__ import annotations

import ast
import json
import math
import operator
from collections.abc import Callable
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field
from typing import Any

__all__ = [
    "Calculator",
    "Lookup",
    "Tool",
    "ToolBox",
    "ToolCall",
    "ToolError",
    "ToolResult",
]


class ToolError(Exception):
    """A tool could not run with these arguments; the message becomes the observation."""


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call of a tool: its name, JSON arguments and the id the chat refers to it by.

    ``source`` says who chose it: ``"model"`` (parsed from the generation) or ``"policy"`` (the
    fallback policy, used only when the generation had no parsable call).
    """

    name: str
    arguments: Mapping[str, Any]
    call_id: str = ""
    source: str = "model"

    def as_message_part(self) -> dict[str, Any]:
        """The OpenAI ``tool_calls`` entry for the assistant message that made this call."""
        return {
            "id": self.call_id,
            "type": "function",
            "function": {
                "name": self.name,
                "arguments": json.dumps(dict(self.arguments), ensure_ascii=False),
            },
        }


@dataclass(frozen=True, slots=True)
class ToolResult:
    """What running a call produced: the observation text and whether it was an error."""

    call: ToolCall
    observation: str
    ok: bool


@dataclass(frozen=True)
class Tool:
    """A named function with an OpenAI function schema."""

    name: str
    description: str
    parameters: Mapping[str, Any]
    run: Callable[[Mapping[str, Any]], str]

    def schema(self) -> dict[str, Any]:
        """The entry for the request's ``tools`` list."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": dict(self.parameters),
            },
        }


def _one_string(name: str, *, example: str) -> dict[str, Any]:
    """The JSON schema of a tool's arguments when they are one required string ``name``."""
    return {
        "type": "object",
        "properties": {name: {"type": "string", "description": f"e.g. {example}"}},
        "required": [name],
    }


# --- calculator ---------------------------------------------------------------------------------

_BINARY: Mapping[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: Mapping[type[ast.unaryop], Callable[[Any], Any]] = {
    ast.UAdd: operator.pos,
    ast.USub: operator.neg,
}


@dataclass(frozen=True)
class Calculator:
    """Evaluates arithmetic on int and float literals: ``+ - * / // % **`` and parentheses.

    The expression is parsed with :mod:`ast` and only those nodes are evaluated, so names, calls
    and attributes are refused rather than executed. Bounds keep a hostile expression cheap:
    ``max_chars`` on the input, ``max_exponent`` on powers, ``max_magnitude`` on every result.
    """

    max_chars: int = 200
    max_exponent: int = 64
    max_magnitude: float = 1e100

    def evaluate(self, expression: object) -> int | float:
        """The value of ``expression``, or :class:`ToolError` saying why not."""
        if not isinstance(expression, str) or not expression.strip():
            raise ToolError("expression must be a non-empty string")
        if len(expression) > self.max_chars:
            raise ToolError(f"expression longer than {self.max_chars} characters")
        try:
            tree = ast.parse(expression.strip(), mode="eval")
        except SyntaxError as exc:
            raise ToolError(f"not an arithmetic expression: {exc.msg}") from None
        return self._eval(tree.body)

    def _eval(self, node: ast.expr) -> int | float:
        value: int | float
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, int | float)
            and not isinstance(node.value, bool)
        ):
            value = node.value
        elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            value = _UNARY[type(node.op)](self._eval(node.operand))
        elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = self._eval(node.left), self._eval(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > self.max_exponent:
                raise ToolError(f"exponent {right} is larger than {self.max_exponent}")
            try:
                value = _BINARY[type(node.op)](left, right)
            except ZeroDivisionError:
                raise ToolError("division by zero") from None
            except OverflowError:
                raise ToolError("result too large") from None
        else:
            raise ToolError(f"unsupported syntax: {type(node).__name__}")
        if isinstance(value, complex):
            raise ToolError("result is not a real number")
        if isinstance(value, float) and not math.isfinite(value):
            raise ToolError("result is not finite")
        if abs(value) > self.max_magnitude:
            raise ToolError("result too large")
        return value

    def __call__(self, arguments: Mapping[str, Any]) -> str:
        value = self.evaluate(arguments.get("expression"))
        if isinstance(value, float) and value.is_integer():
            return str(int(value))
        return str(value) if isinstance(value, int) else f"{value:.12g}"

    def tool(self) -> Tool:
        """This calculator as a :class:`Tool` named ``calculator``."""
        description = "Evaluate an arithmetic expression (+ - * / // % ** and parentheses)."
        return Tool("calculator", description, _one_string("expression", example="17 * 23"), self)


# --- lookup -------------------------------------------------------------------------------------


def _normalise(key: str) -> str:
    return " ".join(key.lower().split())


@dataclass(frozen=True)
class Lookup:
    """Looks a key up in a small in-memory table (case and spacing do not matter)."""

    table: Mapping[str, str]
    _index: dict[str, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        index: dict[str, str] = {}
        for key, value in self.table.items():
            norm = _normalise(key)
            if not norm:
                raise ValueError("a lookup key cannot be empty")
            if norm in index:
                raise ValueError(f"two lookup keys normalise to {norm!r}")
            index[norm] = value
        object.__setattr__(self, "_index", index)

    def get(self, key: object) -> str:
        """The value for ``key``, or :class:`ToolError` naming a few known keys."""
        if not isinstance(key, str) or not key.strip():
            raise ToolError("key must be a non-empty string")
        try:
            return self._index[_normalise(key)]
        except KeyError:
            known = ", ".join(sorted(self._index)[:5])
            raise ToolError(f"no entry for {key!r} (known keys include: {known})") from None

    def __call__(self, arguments: Mapping[str, Any]) -> str:
        return self.get(arguments.get("key"))

    def tool(self) -> Tool:
        """This table as a :class:`Tool` named ``lookup``."""
        description = "Look up a fact by key in the reference table."
        return Tool("lookup", description, _one_string("key", example="population of oslo"), self)


# --- the box ------------------------------------------------------------------------------------


class ToolBox:
    """The tools an agent may call, by name."""

    def __init__(self, tools: list[Tool]) -> None:
        names = [t.name for t in tools]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate tool names in {names}")
        self._tools = {t.name: t for t in tools}

    @property
    def names(self) -> tuple[str, ...]:
        """The tool names, in the order given."""
        return tuple(self._tools)

    def schemas(self) -> list[dict[str, Any]]:
        """The request's ``tools`` list."""
        return [t.schema() for t in self._tools.values()]

    def run(self, call: ToolCall) -> ToolResult:
        """Run ``call``; any failure becomes an ``error: ...`` observation, never an exception."""
        tool = self._tools.get(call.name)
        if tool is None:
            return ToolResult(
                call, f"error: unknown tool {call.name!r} (tools: {', '.join(self._tools)})", False
            )
        try:
            return ToolResult(call, tool.run(call.arguments), True)
        except ToolError as exc:
            return ToolResult(call, f"error: {exc}", False)
