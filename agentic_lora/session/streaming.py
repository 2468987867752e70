"""Streamed generations: the end of the streaming dispatch chain, and the hand-off to the reader.

A streamed dispatch runs the same middleware chain as any other (pin, dispatch guard, routing),
ended by :class:`StreamEndpoint` instead of the one-shot transport endpoint. The chain runs in a
task of its own, the *chain task*, for as long as the engine streams: the endpoint opens the
engine's answer, hands it to the reader through a :class:`StreamHandoff`, and waits there for the
reader's verdict. The reader reads the answer's events itself, inline, as it is iterated. So:

* the version is held for the whole stream: the dispatch guard's in-flight count (the drain a
  vLLM reclaim waits for) and the router's ``on_dispatch``/``on_complete`` bracket the chain
  task, which ends only after the reader's verdict, and the Session's own in-flight record is
  dropped only once the chain task has ended;
* nothing is read ahead of the reader: an event is read from the connection only when the reader
  asks for the next chunk, so a slow reader makes the engine's connection stop at the socket's
  window and this process holds no chunk for it (and no chunk pays a task switch);
* a reader that stops early (``aclose``, cancellation) ends the engine request:
  :meth:`UpstreamStream.aclose` aborts it by id where the dialect can, then cancels the chain
  task, which closes the engine connection (all vLLM learns of it). The end runs in a task of its
  own, so a reader cancelled again while it waits (Starlette cancels a disconnected response's
  scope) still aborts, closes and releases;
* a failure the reader meets (the engine's error event, a cut stream, a lost connection) is its
  verdict: the endpoint raises it, so the middlewares see it as any dispatch failure (the router
  tells its ``on_refused`` listeners of a refusal) before the reader raises what the chain raised;
* failures keep the dispatch path's classification until the first chunk was handed on
  (refused or indeterminate); after it every failure is indeterminate.

The hand-off reaches the endpoint through a context variable set inside the chain task, so
:class:`~agentic_lora.session.middleware.EngineCall` and the middlewares are the non-streaming ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from collections.abc import AsyncIterator
from collections.abc import Callable
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agentic_lora.engines.sse import StreamEvent
from agentic_lora.engines.sse import StreamEventKind
from agentic_lora.engines.sse import error_status
from agentic_lora.engines.transport import EngineReply
from agentic_lora.engines.transport import EngineTransport
from agentic_lora.engines.wire import Outcome
from agentic_lora.engines.wire import classify_status
from agentic_lora.engines.wire import error_detail
from agentic_lora.errors import AgenticLoRAError
from agentic_lora.errors import ConfigurationError
from agentic_lora.errors import DispatchError
from agentic_lora.errors import RequestIndeterminateError
from agentic_lora.errors import RequestRefusedError
from agentic_lora.errors import error_code
from agentic_lora.registry.provenance import TurnProvenance
from agentic_lora.session.in_flight import InFlight
from agentic_lora.session.middleware import Dispatch
from agentic_lora.session.middleware import EngineCall

__all__ = [
    "StreamChunk",
    "StreamEndpoint",
    "StreamHandoff",
    "UpstreamStream",
]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class StreamChunk:
    """One streamed chunk, as the engine sent it (``data``), and the version that produced it.

    ``provenance`` is the Session's binding (never read from the engine's output); None on a
    pass-through Session. Read-only by contract: one is built per chunk, and a frozen dataclass
    (which sets each field through ``object.__setattr__``) cost several times a plain one.
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
class _Opened:
    """The engine's open answer, as the endpoint hands it to the reader."""

    payloads: AsyncIterator[str]
    parse: Callable[[str], StreamEvent]
    where: Mapping[str, Any]


class StreamHandoff:
    """Between the chain task and the reader (see module docstring).

    ``opened``: the engine's open answer, or None when the chain ended without opening one (it
    failed before, or a middleware answered itself). ``verdict``: how the reader's read ended
    (None: at ``[DONE]``, the answer read to its end).
    """

    def __init__(self) -> None:
        loop = asyncio.get_running_loop()
        self.opened: asyncio.Future[_Opened | None] = loop.create_future()
        self.verdict: asyncio.Future[BaseException | None] = loop.create_future()
        #: Chunks handed to the reader so far: from the first one on, failures are indeterminate.
        self.delivered = 0

    def open(self, opened: _Opened | None) -> None:
        # Done already: the reader left while waiting (its future was cancelled) and its end
        # cancels the chain task.
        if not self.opened.done():
            self.opened.set_result(opened)

    def give_verdict(self, error: BaseException | None) -> None:
        if not self.verdict.done():
            self.verdict.set_result(error)


_HANDOFF: contextvars.ContextVar[StreamHandoff | None] = contextvars.ContextVar(
    "agentic_lora_stream_handoff", default=None
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
    """The end of the streaming chain: opens one streamed send and hands it to the reader.

    Returns (an :class:`~agentic_lora.engines.transport.EngineReply` without a body) only once the reader
    read ``[DONE]``, and raises the failure the reader met, so every middleware around it
    brackets the whole stream.
    """

    def __init__(self, transport: EngineTransport) -> None:
        self._transport = transport

    async def __call__(self, call: EngineCall) -> EngineReply:
        handoff = _HANDOFF.get()
        if handoff is None or call.engine is None:
            raise ConfigurationError(
                "a streamed dispatch reached the stream endpoint outside a chain task, or unrouted",
                check="stream_chain",
            )
        path = call.route.value
        rid = call.body.get("rid")
        where = {"engine": call.engine, "path": path, "rid": rid}
        async with self._transport.open_stream(call.engine, path, call.body) as payloads:
            handoff.open(_Opened(payloads, self._transport.dialect.parse_stream_event, where))
            # The answer stays open (and the middlewares' brackets held) until the reader is done.
            error = await handoff.verdict
        if error is not None:
            raise error
        return EngineReply(call.engine, path, 200, None, rid if isinstance(rid, str) else None)


#: Payloads read after ``[DONE]`` at most (the engines send none: the body ends after it).
_AFTER_DONE_PAYLOADS = 8


async def _read_to_end(payloads: AsyncIterator[str]) -> None:
    """Read what follows ``[DONE]`` so the answer ends before it is closed.

    An answer closed before its end closes its connection instead of returning it to the pool,
    so every stream of the process paid a new TCP connection to the engine before its first
    chunk (part of the time-to-first-chunk gap at 64 concurrent streams on SGLang). The stream
    itself is complete: a failure or an engine that keeps talking only costs the connection.
    """
    with contextlib.suppress(RequestIndeterminateError):
        for _ in range(_AFTER_DONE_PAYLOADS):
            if await anext(payloads, None) is None:
                return


async def _run_chain(chain: Dispatch, call: EngineCall, handoff: StreamHandoff) -> None:
    _HANDOFF.set(handoff)  # this task's own context: no other dispatch sees it
    try:
        await chain(call)
    finally:
        handoff.open(None)  # ended without an open answer: the reader reads the task's result


# Ends still running after their reader left (cancelled): held here so none is collected.
_ENDING: set[asyncio.Task[None]] = set()


class UpstreamStream:
    """One streamed dispatch in flight: the chain task and its hand-off (see module docstring).

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
    ) -> None:
        self._handoff = StreamHandoff()
        self._flight = call.ticket
        self._transport = transport
        self._can_abort = can_abort
        self._task = asyncio.get_running_loop().create_task(
            _run_chain(chain, call, self._handoff), name=f"stream {call.body.get('rid')}"
        )

    @property
    def handoff(self) -> StreamHandoff:
        """The hand-off between the chain task and the reader."""
        return self._handoff

    async def __aiter__(self) -> AsyncIterator[Mapping[str, Any]]:
        handoff = self._handoff
        opened = await handoff.opened
        if opened is not None:
            # Read inline, one event per chunk asked for (see the module docstring): no task
            # switch and no queue between the connection and the reader.
            parse = opened.parse
            try:
                async for payload in opened.payloads:
                    event = parse(payload)
                    if event.kind is StreamEventKind.CHUNK:
                        assert event.data is not None
                        handoff.delivered += 1
                        yield event.data
                    elif event.kind is StreamEventKind.DONE:
                        await _read_to_end(opened.payloads)
                        break
                    else:
                        raise _event_failure(event, handoff.delivered, opened.where)
                else:
                    end = StreamEvent(StreamEventKind.DONE)
                    raise _event_failure(end, handoff.delivered, opened.where)
            except Exception as exc:
                if isinstance(exc, RequestIndeterminateError):
                    exc.details.setdefault("chunks", handoff.delivered)
                handoff.give_verdict(exc)  # raised by the endpoint, through the middlewares
            else:
                handoff.give_verdict(None)
        try:
            # Shielded: a reader cancelled here leaves the chain task to aclose's end.
            await asyncio.shield(self._task)
        except Exception as exc:
            error: BaseException = exc
        else:
            return
        raise self._classified(error)

    def _classified(self, error: BaseException) -> BaseException:
        delivered = self._handoff.delivered
        if delivered == 0 or isinstance(error, RequestIndeterminateError):
            return error
        # After the first chunk the engine had the request: nothing else can be said.
        code = error_code(error)
        wrapped = RequestIndeterminateError(
            f"the stream failed after {delivered} chunk(s) ({code}); the generation "
            "ran in part [indeterminate]",
            outcome=Outcome.INDETERMINATE.value,
            chunks=delivered,
            cause=code,
        )
        wrapped.__cause__ = error
        return wrapped

    async def aclose(self, on_ended: Callable[[], None] | None = None) -> None:
        """End the engine request if it still runs; ``on_ended()`` runs once the chain ended.

        The work runs in a task of its own and is awaited shielded: a reader cancelled while it
        waits leaves it running to the end (abort sent, connection closed, ``on_ended`` called).
        """
        if self._task.done():
            # The common end (the reader read the chain's result): nothing left to stop.
            self._settle()
            if on_ended is not None:
                on_ended()
            return
        ending = asyncio.get_running_loop().create_task(self._end(on_ended))
        _ENDING.add(ending)
        ending.add_done_callback(_ENDING.discard)
        await asyncio.shield(ending)

    def _settle(self) -> None:
        # The chain's failure reached the reader, or nobody is left to hear it: retrieved here
        # so that asyncio does not report it as never retrieved.
        if not self._task.cancelled():
            self._task.exception()

    async def _end(self, on_ended: Callable[[], None] | None) -> None:
        try:
            if not self._task.done():
                if not self._handoff.verdict.done():
                    await self._abort()  # the reader left while the engine may still generate
                self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        finally:
            if on_ended is not None:
                on_ended()

    async def _abort(self) -> None:
        flight: InFlight | None = self._flight
        if not self._can_abort or flight is None or flight.engine is None or flight.rid is None:
            return  # the chain task's cancellation closes the connection: the engine's only signal
        try:
            await self._transport.abort(flight.engine, flight.rid)
        except AgenticLoRAError as exc:
            # Closing the connection still follows (SGLang aborts a disconnected request too).
            logger.warning(
                "abort of an abandoned stream failed",
                extra={"engine": flight.engine, "rid": flight.rid, "error": exc.code},
            )
