"""One chat turn read from :meth:`Session.stream` and put back together as a chat completion.

The agent reads whole replies (tool calls, logprobs, usage); with ``--stream`` it asks for the
turn as a stream, as OpenAI-SDK agents do by default, and assembles the chunks into the body a
non-streamed turn would have returned. Every chunk names its version (from the Session's
binding); a stream whose chunks named two versions is refused as a bad reply.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agentic_lora.foundation.requests import Route
from agentic_lora.registry.provenance import TurnProvenance
from agentic_lora.session import Session

__all__ = ["StreamedTurn", "stream_turn"]


@dataclass(frozen=True, slots=True)
class StreamedTurn:
    """A streamed turn, assembled: the engine, the chat-completion body, the turn's provenance."""

    engine: str
    body: dict[str, Any]
    provenance: TurnProvenance | None
    chunks: int


def _merge_tool_calls(calls: dict[int, dict[str, Any]], deltas: Any) -> None:
    for delta in deltas if isinstance(deltas, list) else []:
        if not isinstance(delta, Mapping):
            continue
        call = calls.setdefault(
            int(delta.get("index", len(calls))),
            {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
        )
        if delta.get("id"):
            call["id"] = delta["id"]
        function = delta.get("function")
        if isinstance(function, Mapping):
            call["function"]["name"] += function.get("name") or ""
            call["function"]["arguments"] += function.get("arguments") or ""


async def stream_turn(session: Session, body: Mapping[str, Any]) -> StreamedTurn:
    """Stream one chat turn of ``session`` and assemble it (ValueError: two versions, or no
    chunk)."""
    content: list[str] = []
    logprobs: list[Any] = []
    calls: dict[int, dict[str, Any]] = {}
    finish: str | None = None
    usage: Any = None
    model: Any = None
    engine = ""
    provenance: TurnProvenance | None = None
    versions: set[str | None] = set()
    count = 0
    request = {**body, "stream_options": {"include_usage": True}}
    async for chunk in session.stream(Route.CHAT_COMPLETIONS, request):
        count += 1
        engine, provenance, model = chunk.engine, chunk.provenance, chunk.data.get("model")
        versions.add(chunk.version_id)
        usage = chunk.data.get("usage") or usage
        for choice in chunk.data.get("choices") or ():
            delta = choice.get("delta") or {}
            content.append(delta.get("content") or "")
            _merge_tool_calls(calls, delta.get("tool_calls"))
            entries = (choice.get("logprobs") or {}).get("content")
            logprobs.extend(entries if isinstance(entries, list) else ())
            finish = choice.get("finish_reason") or finish
    if count == 0:
        raise ValueError("a streamed turn without a chunk")
    if len(versions) != 1:
        raise ValueError(f"a streamed turn named {len(versions)} versions")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(content)}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    choice = {"index": 0, "message": message, "finish_reason": finish}
    if logprobs:
        choice["logprobs"] = {"content": logprobs}
    reply = {"object": "chat.completion", "model": model, "choices": [choice], "usage": usage}
    return StreamedTurn(engine, reply, provenance, count)
