"""Streamed generations: the end of the streaming dispatch chain, and the hand-off to the reader.

A streamed dispatch runs the same middleware chain as any other (pin, dispatch guard, routing),
ended by :class:`StreamEndpoint` instead of the one-shot transport endpoint. The chain runs in a
task of its own, the *pump*, for as long as the engine streams, and hands each chunk to the
reader through a :class:`StreamSink`, a bounded queue. So:

* the version is held for the whole stream: the dispatch guard's in-flight count (the drain a
  vLLM reclaim waits for) and the router's ``on_dispatch``/``on_complete`` bracket the pump, and
  the Session's own in-flight record is dropped only once the pump has ended;
* a slow reader never makes this process buffer more than ``buffer`` chunks: a full sink stops
  the pump reading, and the engine's connection then stops at the socket's window;
* a reader that stops early (``aclose``, cancellation) ends the engine request:
  :func:`end_upstream` aborts it by id where the dialect can, then cancels the pump, which closes
  the engine connection (all vLLM learns of it). The end runs in a task of its own, so a reader
  cancelled again while it waits (Starlette cancels a disconnected response's scope) still
  aborts, closes and releases;
* failures keep the dispatch path's classification until the first chunk was handed on
  (refused or indeterminate); after it every failure is indeterminate.

The sink reaches the endpoint through a context variable set inside the pump task, so
:class:`~agentic_lora.session.middleware.EngineCall` and the middlewares are the non-streaming ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from agentic_lora.engines.sse import StreamEvent, StreamEventKind, data_payloads, error_status
from agentic_lora.engines.transport import EngineReply, EngineTransport
from agentic_lora.engines.wire import Outcome, classify_status, error_detail
from agentic_lora.errors import (
    AgenticLoRAError,
    ConfigurationError,
    DispatchError,
    RequestIndeterminateError,
    RequestRefusedError,
)
from agentic_lora.registry.provenance import TurnProvenance
from agentic_lora.session.middleware import Dispatch, EngineCall, InFlight

__all__ = [
    "DEFAULT_STREAM_BUFFER",
    "StreamChunk",
    "StreamEndpoint",
    "StreamSink",
    "UpstreamStream",
]

logger = logging.getLogger(__name__)

#: Chunks a stream holds for a reader that has not taken them yet.
DEFAULT_STREAM_BUFFER: Final = 16


@dataclass(frozen=True, slots=True)
class StreamChunk:
    """One streamed chunk, as the engine sent it (``data``), and the version that produced it.

    ``provenance`` is the Session's binding (never read from the engine's output); None on a
    pass-through Session.
    """

    engine: str
    path: str
    data: Mapping[str, Any]
    rid: str | None = None
    provenance: TurnProvenance | None = None

    @property
    def version_id(self) -> str | None:
        """The version every chunk of this stream carries (None: pass-through)."""
        return self.provenance.version_id if self.provenance is not None else None


@dataclass(frozen=True, slots=True)
class _End:
    error: BaseException | None


class StreamSink:
    """The bounded hand-off from the pump to the reader (see module docstring)."""

    def __init__(self, buffer: int = DEFAULT_STREAM_BUFFER) -> None:
        if buffer < 1:
            raise ConfigurationError("a stream buffer holds at least one chunk", check="buffer")
        self._queue: asyncio.Queue[Mapping[str, Any] | _End] = asyncio.Queue(buffer)
        self.buffer = buffer
        #: Chunks handed to the queue so far: from the first one on, failures are indeterminate.
        self.delivered = 0
        #: Set while the pump waits for the reader (the buffer is full).
        self.waiting = asyncio.Event()

    async def put(self, chunk: Mapping[str, Any]) -> None:
        """Hand on one chunk; waits while the reader is ``buffer`` chunks behind."""
        if self._queue.full():
            self.waiting.set()
        await self._queue.put(chunk)
        self.waiting.clear()
        self.delivered += 1

    async def finish(self, error: BaseException | None) -> None:
        """The stream ended (``error``: how it failed)."""
        await self._queue.put(_End(error))

    async def get(self) -> Mapping[str, Any] | _End:
        return await self._queue.get()


_SINK: contextvars.ContextVar[StreamSink | None] = contextvars.ContextVar(
    "agentic_lora_stream_sink", default=None
)


def _event_failure(event: StreamEvent, delivered: int, where: Mapping[str, Any]) -> DispatchError:
    if event.kind is StreamEventKind.ERROR:
        data = event.data or {}
        status = error_status(data)
        # Before any chunk, the engine's own status keeps today's meaning (a 4xx: it refused).
        outcome = (
            classify_status(status) if delivered == 0 and status is not None else None
        ) or Outcome.INDETERMINATE
        cls = RequestRefusedError if outcome is Outcome.REFUSED else RequestIndeterminateError
        return cls(
            f"the engine ended the stream with an error after {delivered} chunk(s): "
            f"{error_detail(data)} [{outcome.value}]",
            outcome=outcome.value,
            status=status,
            chunks=delivered,
            reason="stream_error",
            **where,
        )
    return RequestIndeterminateError(
        f"the engine's stream broke off after {delivered} chunk(s) "
        f"({'an unreadable event' if event.kind is StreamEventKind.UNREADABLE else 'no [DONE]'}); "
        "the generation may have run [indeterminate]",
        outcome=Outcome.INDETERMINATE.value,
        chunks=delivered,
        reason="stream_cut",
        **where,
    )


class StreamEndpoint:
    """The end of the streaming chain: one streamed send; each chunk goes to the pump's sink.

    Returns (an :class:`~agentic_lora.engines.transport.EngineReply` without a body) only at
    ``[DONE]``, so every middleware around it brackets the whole stream.
    """

    def __init__(self, transport: EngineTransport) -> None:
        self._transport = transport

    async def __call__(self, call: EngineCall) -> EngineReply:
        sink = _SINK.get()
        if sink is None or call.engine is None:
            raise ConfigurationError(
                "a streamed dispatch reached the stream endpoint outside a pump, or unrouted",
                check="stream_chain",
            )
        path = call.route.value
        rid = call.body.get("rid")
        where = {"engine": call.engine, "path": path, "rid": rid}
        parse = self._transport.dialect.parse_stream_event
        try:
            async with self._transport.open_stream(call.engine, path, call.body) as lines:
                async for payload in data_payloads(lines):
                    event = parse(payload)
                    if event.kind is StreamEventKind.CHUNK:
                        assert event.data is not None
                        await sink.put(event.data)
                    elif event.kind is StreamEventKind.DONE:
                        await _read_to_end(lines)
                        return EngineReply(
                            call.engine, path, 200, None, rid if isinstance(rid, str) else None
                        )
                    else:
                        raise _event_failure(event, sink.delivered, where)
        except RequestIndeterminateError as exc:
            exc.details.setdefault("chunks", sink.delivered)
            raise
        raise _event_failure(StreamEvent(StreamEventKind.DONE), sink.delivered, where)


#: Lines read after ``[DONE]`` at most (the engines send a blank line, then end the body).
_AFTER_DONE_LINES = 8


async def _read_to_end(lines: AsyncIterator[str]) -> None:
    """Read what follows ``[DONE]`` so the answer ends before it is closed.

    An answer closed before its end closes its connection instead of returning it to the pool,
    so every stream of the process paid a new TCP connection to the engine before its first
    chunk (part of the time-to-first-chunk gap at 64 concurrent streams on SGLang). The stream
    itself is complete: a failure or an engine that keeps talking only costs the connection.
    """
    with contextlib.suppress(RequestIndeterminateError):
        for _ in range(_AFTER_DONE_LINES):
            if await anext(lines, None) is None:
                return


async def _pump(chain: Dispatch, call: EngineCall, sink: StreamSink) -> None:
    _SINK.set(sink)  # this task's own context: no other dispatch sees it
    try:
        await chain(call)
    except Exception as exc:
        await sink.finish(exc)
    else:
        await sink.finish(None)


# Ends still running after their reader left (cancelled): held here so none is collected.
_ENDING: set[asyncio.Task[None]] = set()


class UpstreamStream:
    """One streamed dispatch in flight: the pump task and its sink (see module docstring).

    Iterate it for the engine's chunk objects; always :meth:`aclose` it (a generator's
    ``finally``), which ends the engine request unless it ended already.
    """

    def __init__(
        self,
        chain: Dispatch,
        call: EngineCall,
        transport: EngineTransport,
        *,
        can_abort: bool,
        buffer: int = DEFAULT_STREAM_BUFFER,
    ) -> None:
        self._sink = StreamSink(buffer)
        self._flight = call.ticket
        self._transport = transport
        self._can_abort = can_abort
        self._task = asyncio.get_running_loop().create_task(
            _pump(chain, call, self._sink), name=f"stream {call.body.get('rid')}"
        )

    @property
    def sink(self) -> StreamSink:
        """The hand-off between the pump and the reader."""
        return self._sink

    async def __aiter__(self) -> AsyncIterator[Mapping[str, Any]]:
        while True:
            item = await self._sink.get()
            if not isinstance(item, _End):
                yield item
                continue
            if item.error is None:
                return
            raise self._classified(item.error)

    def _classified(self, error: BaseException) -> BaseException:
        if self._sink.delivered == 0 or isinstance(error, RequestIndeterminateError):
            return error
        # After the first chunk the engine had the request: nothing else can be said.
        code = error.code if isinstance(error, AgenticLoRAError) else type(error).__name__
        wrapped = RequestIndeterminateError(
            f"the stream failed after {self._sink.delivered} chunk(s) ({code}); the generation "
            "ran in part [indeterminate]",
            outcome=Outcome.INDETERMINATE.value,
            chunks=self._sink.delivered,
            cause=code,
        )
        wrapped.__cause__ = error
        return wrapped

    async def aclose(self, on_ended: Callable[[], None] | None = None) -> None:
        """End the engine request if it still runs; ``on_ended()`` runs once the pump ended.

        The work runs in a task of its own and is awaited shielded: a reader cancelled while it
        waits leaves it running to the end (abort sent, connection closed, ``on_ended`` called).
        """
        ending = asyncio.get_running_loop().create_task(self._end(on_ended))
        _ENDING.add(ending)
        ending.add_done_callback(_ENDING.discard)
        await asyncio.shield(ending)

    async def _end(self, on_ended: Callable[[], None] | None) -> None:
        try:
            if not self._task.done():
                await self._abort()
                self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        finally:
            if on_ended is not None:
                on_ended()

    async def _abort(self) -> None:
        flight: InFlight | None = self._flight
        if not self._can_abort or flight is None or flight.engine is None or flight.rid is None:
            return  # the pump's cancellation closes the connection: the engine's only signal
        try:
            await self._transport.abort(flight.engine, flight.rid)
        except AgenticLoRAError as exc:
            # Closing the connection still follows (SGLang aborts a disconnected request too).
            logger.warning(
                "abort of an abandoned stream failed",
                extra={"engine": flight.engine, "rid": flight.rid, "error": exc.code},
            )
