"""Scripted streamed replies: what SGLang and vLLM send for ``"stream": true``, step by step.

A :class:`ScriptedStream` is the body of one streamed answer (mount it with :func:`stream_reply`
from a scripted engine's handler). It sends its chunks as server-sent events and ends as
scripted (:class:`StreamEnding`): ``[DONE]``; the engine's error object then ``[DONE]``; a
connection dropped mid-stream; or an end without ``[DONE]``. It can hold after a number of
chunks until :attr:`ScriptedStream.gate` is set, is aborted by :meth:`ScriptedStream.abort`
(what ``/abort_request`` does: a last chunk with ``finish_reason`` ``abort``, then ``[DONE]``),
and records, from the engine's side, whether the reader closed it before its end
(:attr:`ScriptedStream.closed_early`). Deterministic: no clocks, no sleeps.

Chunk shapes: :func:`generate_chunks` (SGLang ``/generate``: cumulative ``text`` and
``meta_info``) and :func:`openai_chunks` (``chat.completion.chunk`` / ``text_completion``).
"""

from __future__ import annotations

import asyncio
import enum
import json
from collections.abc import AsyncIterator
from collections.abc import Awaitable
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import httpx

__all__ = [
    "ScriptedStream",
    "StreamEnding",
    "generate_chunks",
    "openai_chunks",
    "stream_reply",
]


class StreamEnding(enum.StrEnum):
    """How a scripted stream ends after its chunks."""

    DONE = "done"  # data: [DONE]
    ERROR = "error"  # the engine's error object, then [DONE] (as SGLang and vLLM send it)
    DROP = "drop"  # the connection drops (a read error on the client)
    EOF = "eof"  # the body ends without [DONE]


def generate_chunks(count: int, rid: str | None, lora_path: str | None) -> list[dict[str, Any]]:
    """SGLang ``/generate`` stream chunks: cumulative ``text`` and ``output_ids``; the last one
    carries the finish reason."""
    return [
        {
            "text": "x" * (i + 1),
            "output_ids": list(range(i + 1)),
            "meta_info": {
                "id": rid,
                "lora_path": lora_path,
                "completion_tokens": i + 1,
                "finish_reason": {"type": "length", "length": count} if i == count - 1 else None,
            },
        }
        for i in range(count)
    ]


def openai_chunks(count: int, path: str, model: str | None) -> list[dict[str, Any]]:
    """OpenAI stream chunks of ``path``: one token each, the last with ``finish_reason``."""
    chat = path.endswith("chat/completions")
    out: list[dict[str, Any]] = []
    for i in range(count):
        finish = "length" if i == count - 1 else None
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
        if chat:
            choice["delta"] = {"content": "x"} if i else {"role": "assistant", "content": "x"}
        else:
            choice["text"] = "x"
        out.append(
            {
                "id": "cmpl-stream",
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": 0,
                "model": model,
                "choices": [choice],
            }
        )
    return out


def _event(data: Mapping[str, Any] | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data)
    return f"data: {text}\n\n".encode()


class ScriptedStream(httpx.AsyncByteStream):
    """One streamed answer (see module docstring). ``chunks`` may be set by the engine that
    answers with it (when the test left them None), from the request it received."""

    def __init__(
        self,
        chunks: Sequence[Mapping[str, Any]] | None = None,
        *,
        hold_after: int | None = None,
        ending: StreamEnding = StreamEnding.DONE,
        error_status: int = 500,
    ) -> None:
        self.chunks: Sequence[Mapping[str, Any]] | None = (
            list(chunks) if chunks is not None else None
        )
        self.hold_after = hold_after
        self.ending = ending
        self.error_status = error_status
        #: Set to let a stream held at ``hold_after`` go on.
        self.gate = asyncio.Event()
        #: Set when the stream reached ``hold_after`` and waits for :attr:`gate`.
        self.held = asyncio.Event()
        #: Set when the reader closed the answer before its last event (a client disconnect).
        self.closed_early = asyncio.Event()
        #: Set when the stream sent its last event.
        self.finished = asyncio.Event()
        #: Set when the engine was asked to abort the request (``/abort_request``).
        self.aborted = asyncio.Event()
        self.sent = 0
        #: Called once when the request ends on the engine's side (finished or abandoned).
        self.on_end: Callable[[], Awaitable[None]] | None = None

    def abort(self) -> None:
        """End the request as an engine's abort does (a last ``abort`` chunk, then [DONE])."""
        self.aborted.set()
        self.gate.set()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks or ():
            if self.hold_after is not None and self.sent == self.hold_after:
                self.held.set()
                await self.gate.wait()
            if self.aborted.is_set():
                break
            self.sent += 1
            yield _event(chunk)
        tail: list[bytes] = []
        if self.aborted.is_set():
            tail.append(_event({"meta_info": {"finish_reason": {"type": "abort"}}, "text": ""}))
        elif self.ending is StreamEnding.ERROR:
            message = {"message": "scripted failure", "code": self.error_status}
            tail.append(_event({"error": {**message, "type": "InternalServerError"}}))
        if self.aborted.is_set() or self.ending in (StreamEnding.ERROR, StreamEnding.DONE):
            tail.append(_event("[DONE]"))
        for i, event in enumerate(tail):
            if i == len(tail) - 1:
                # Sent in full once the last event is out: a reader that stops reading after
                # [DONE] did not leave early.
                self.finished.set()
                await self._ended()
            yield event
        if self.ending is StreamEnding.DROP and not self.aborted.is_set():
            raise httpx.ReadError("connection dropped mid-stream (scripted)")
        self.finished.set()
        await self._ended()

    async def aclose(self) -> None:
        if not self.finished.is_set():
            self.closed_early.set()
        await self._ended()

    async def _ended(self) -> None:
        on_end, self.on_end = self.on_end, None
        if on_end is not None:
            await on_end()


def stream_reply(stream: ScriptedStream) -> httpx.Response:
    """A 200 answer whose body is ``stream``, as ``text/event-stream``."""
    return httpx.Response(200, stream=stream, headers={"content-type": "text/event-stream"})
