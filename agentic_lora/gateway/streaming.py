"""Streamed generation answers of the gateway: server-sent events, each chunk naming its version.

A streamed request (``"stream": true``) is one :meth:`~agentic_lora.session.Session.stream`. Its
first chunk is awaited before the answer starts, so a failure before it is an ordinary error
answer (status, ``X-Agentic-Outcome``), as for a request that does not stream. From then on the
answer is ``text/event-stream``:

* every chunk is the engine's chunk object with the turn's provenance added from the binding
  (never from the engine's output): on the OpenAI routes as the ``agentic_lora`` extension
  field of the chunk object, on ``/generate`` inside its ``meta_info``;
* it ends with ``data: [DONE]``, or, if the generation failed after the first chunk, with one
  final error event (``data: {"error": {"code", "message", "details"}}``, the gateway's error
  shape, which OpenAI clients raise as an API error): never cut short silently;
* a client that disconnects ends the Session's stream, which aborts the engine request
  (:class:`SSEResponse` listens for the disconnect whatever the server's ASGI version, so a
  stream waiting on a slow engine notices it too);
* one chunk at a time is written, and the Session's stream reads the engine's next chunk only
  when asked for it (:mod:`agentic_lora.session.streaming`): a slow reader slows the engine read
  instead of growing a buffer here.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncGenerator
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive
from starlette.types import Scope
from starlette.types import Send

from agentic_lora.foundation.requests import Route
from agentic_lora.gateway.wire import error_payload
from agentic_lora.gateway.wire import jsonable
from agentic_lora.session.streaming import StreamChunk

__all__ = ["SSE_MEDIA_TYPE", "SSEResponse", "sse_events", "tagged_chunk"]

SSE_MEDIA_TYPE = "text/event-stream"
_DONE = b"data: [DONE]\n\n"


def tagged_chunk(route: Route, chunk: StreamChunk, field: str) -> Mapping[str, Any]:
    """The engine's chunk with the turn's provenance under ``field`` (OpenAI routes: on the
    chunk object; ``/generate``: in its ``meta_info``). A copy: the chunk stays as received."""
    data = chunk.data
    if chunk.provenance is None:
        return data
    turn = chunk.provenance.to_dict()
    if route.is_openai:
        return {**data, field: turn}
    meta = data.get("meta_info")
    return {**data, "meta_info": {**(meta if isinstance(meta, Mapping) else {}), field: turn}}


def _event(data: Mapping[str, Any]) -> bytes:
    try:
        text = json.dumps(data, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        # Carried as the engine sent it would not be JSON: summarised, never dropped.
        text = json.dumps(jsonable(data), separators=(",", ":"), ensure_ascii=False)
    return b"data: " + text.encode() + b"\n\n"


async def sse_events(
    route: Route,
    first: StreamChunk | None,
    rest: AsyncGenerator[StreamChunk, None],
    field: str,
    on_end: Callable[[BaseException | None], None],
) -> AsyncGenerator[bytes, None]:
    """The answer's events: ``first``, then ``rest``, then ``[DONE]`` or the final error event.

    ``on_end(error)`` is told how the stream ended (None: ``[DONE]``), before the last event.
    Closing this iterator early (a disconnect) closes ``rest``, which ends the engine request.
    """
    try:
        if first is not None:
            yield _event(tagged_chunk(route, first, field))
        async for chunk in rest:
            yield _event(tagged_chunk(route, chunk, field))
    except Exception as exc:
        on_end(exc)
        yield _event(error_payload(exc))
        return
    finally:
        await rest.aclose()
    on_end(None)
    yield _DONE


class SSEResponse(StreamingResponse):
    """A streamed answer that always listens for the client's disconnect while it streams.

    Starlette stops listening under ASGI 2.4 servers and learns of a disconnect only when a
    write fails, which a stream waiting on the engine may not attempt for a long time; here the
    disconnect cancels the stream at once (its ``finally`` aborts the engine request).
    """

    media_type = SSE_MEDIA_TYPE

    def __init__(self, events: AsyncGenerator[bytes, None], headers: Mapping[str, str]) -> None:
        super().__init__(events, headers=headers, media_type=SSE_MEDIA_TYPE)
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    with contextlib.suppress(OSError):  # the client is gone: see below
                        await self.stream_response(send)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            # Shielded: a disconnect cancelled the group, and closing the events is what ends
            # the engine request (abort by id, or its connection closed).
            with anyio.CancelScope(shield=True):
                await self._events.aclose()
