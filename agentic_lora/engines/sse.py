"""The server-sent events an engine streams a generation in, read one ``data:`` payload at a time.

SGLang's ``/generate`` and the OpenAI routes of SGLang and vLLM stream the same way: one
``data: <JSON object>`` event per chunk, a blank line after each, and ``data: [DONE]`` last. A
failure the engine meets while streaming arrives as one more event, ``data: {"error": {...}}``
(SGLang and vLLM both send ``[DONE]`` after it). :func:`parse_event` reads one payload into a
:class:`StreamEvent`; :func:`data_payload` picks the payload out of one of a stream's lines.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["DONE", "StreamEvent", "StreamEventKind", "data_payload", "error_status", "parse_event"]

#: The payload of the event that ends a stream.
DONE = "[DONE]"


class StreamEventKind(enum.StrEnum):
    """What one streamed event is."""

    CHUNK = "chunk"  # one chunk object of the generation
    ERROR = "error"  # the engine's error object: the generation failed while streaming
    DONE = "done"  # the stream's last event
    UNREADABLE = "unreadable"  # not a JSON object: the stream cannot be trusted past it


# Not frozen: one is built per streamed chunk, and a frozen dataclass sets each field through
# object.__setattr__ (several times the cost of a plain slotted one). Never changed in place.
@dataclass(slots=True)
class StreamEvent:
    """One parsed ``data:`` payload; ``data`` is the JSON object (None for DONE/UNREADABLE)."""

    kind: StreamEventKind
    data: Mapping[str, Any] | None = None


def parse_event(payload: str) -> StreamEvent:
    """The event one ``data:`` payload carries (an object with ``error``, or OpenAI's legacy
    ``"object": "error"``, is an ERROR)."""
    text = payload.strip()
    if text == DONE:
        return StreamEvent(StreamEventKind.DONE)
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        return StreamEvent(StreamEventKind.UNREADABLE)
    if not isinstance(data, dict):
        return StreamEvent(StreamEventKind.UNREADABLE)
    if data.get("error") is not None or data.get("object") == "error":
        return StreamEvent(StreamEventKind.ERROR, data)
    return StreamEvent(StreamEventKind.CHUNK, data)


def error_status(error: Mapping[str, Any]) -> int | None:
    """The HTTP status an engine's streamed error object names (``error.code`` or ``code``)."""
    inner = error.get("error")
    for source in (inner if isinstance(inner, Mapping) else {}, error):
        code = source.get("code")
        if isinstance(code, int) and not isinstance(code, bool):
            return code
    return None


def data_payload(line: str) -> str | None:
    """The ``data:`` payload of one of an event stream's lines; None for comments, other fields
    and blank lines (the engines put every event on one ``data:`` line)."""
    if line.startswith("data:"):
        return line[5:].removeprefix(" ")
    return None
