"""One agent Session: its dispatches and its close (see :mod:`agentic_lora.session`).

Its phases and the moves between them are the pure table in :mod:`~agentic_lora.session.transitions`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator
from collections.abc import Awaitable
from collections.abc import Callable
from collections.abc import Coroutine
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from typing import Final

from agentic_lora.engines.dialect import EngineDialect
from agentic_lora.engines.transport import EngineReply
from agentic_lora.engines.transport import EngineTransport
from agentic_lora.errors import AgenticLoRAError
from agentic_lora.errors import InvalidRequestError
from agentic_lora.errors import SessionClosedError
from agentic_lora.errors import SessionStateError
from agentic_lora.foundation.requests import RequestLike
from agentic_lora.foundation.requests import Route
from agentic_lora.foundation.requests import check_shape
from agentic_lora.foundation.requests import request_body
from agentic_lora.leases import LeaseTerm
from agentic_lora.registry.provenance import TurnProvenance
from agentic_lora.registry.types import Binding
from agentic_lora.registry.types import ReleaseResult
from agentic_lora.session.binder import SessionBinder
from agentic_lora.session.in_flight import InFlight
from agentic_lora.session.middleware import Dispatch
from agentic_lora.session.middleware import EngineCall
from agentic_lora.session.streaming import StreamChunk
from agentic_lora.session.streaming import UpstreamStream
from agentic_lora.session.transitions import SessionPhase
from agentic_lora.session.transitions import next_phase

__all__ = ["Session", "SessionRuntime"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SessionRuntime:
    """What every Session of one Versioning shares (the binder is each Session's own)."""

    chain: Dispatch
    transport: EngineTransport
    dialect: EngineDialect
    new_binder: Callable[[str, Callable[[], None]], SessionBinder]
    on_closed: Callable[[Session], Awaitable[None]]
    #: The same middlewares ended by :class:`~agentic_lora.session.streaming.StreamEndpoint`.
    stream_chain: Dispatch | None = None
    #: The whole registry side of a close (``begin_close``, ``release``, ``forget_sessions``) and
    #: the end of the Session's record, in one synchronous step: ``(True, release result)``, or
    #: ``(False, None)`` with nothing done when it cannot be had without waiting.
    close_now: Callable[[Session], tuple[bool, ReleaseResult | None]] | None = None


class Session:
    """One agent Session (see :mod:`agentic_lora.session`). Create it with
    :meth:`~agentic_lora.session.Versioning.open_session`."""

    def __init__(self, session_id: str, session_key: str, runtime: SessionRuntime) -> None:
        self.session_id: Final = session_id
        """The framework's id for this Session (reused ids are new lifecycles)."""
        self.key: Final = session_key
        """The registry key: session id plus a nonce unique to this lifecycle."""
        self._rt = runtime
        self._phase = SessionPhase.OPEN
        self._binder = runtime.new_binder(session_key, self._on_bound)
        self._close_task: asyncio.Task[ReleaseResult | None] | None = None
        self._release_result: ReleaseResult | None = None
        self._in_flight: set[InFlight] = set()
        # Both events are made only when something waits on them: most Sessions close with
        # nothing in flight, and an event per Session (or a clear per dispatch) is pure cost.
        self._drained: asyncio.Event | None = None
        self._close_waits: asyncio.Event | None = None

    # --- what it is ------------------------------------------------------------------------------

    @property
    def phase(self) -> SessionPhase:
        """The current phase."""
        return self._phase

    @property
    def binding(self) -> Binding | None:
        """The version this Session is bound to (None before its first generation)."""
        return self._binder.binding

    @property
    def in_flight(self) -> int:
        """Requests of this Session currently dispatched and not yet ended."""
        return len(self._in_flight)

    @property
    def close_waits(self) -> asyncio.Event:
        """Set when :meth:`close` starts waiting for requests still in flight (after aborting
        those the engine can abort); never set when nothing was in flight at that point."""
        event = self._close_waits
        if event is None:
            event = self._close_waits = asyncio.Event()
        return event

    @property
    def lease(self) -> LeaseTerm | None:
        """The owner lease this Session binds under (None before its first bind, or lease-free)."""
        return self._binder.lease

    @property
    def release_result(self) -> ReleaseResult | None:
        """The registry's answer to the release, once the Session is CLOSED (versioned only)."""
        return self._release_result

    def __repr__(self) -> str:
        binding = self._binder.binding
        version = binding.version_id if binding else None
        return f"Session({self.key!r}, {self._phase.value}, version={version!r})"

    def _advance(self, target: SessionPhase) -> None:
        self._phase = next_phase(self._phase, target, session=self.key)

    def _on_bound(self) -> None:
        # Close may have begun while the bind ran: then the Session stays FINALIZING.
        if self._phase is SessionPhase.OPEN:
            self._advance(SessionPhase.BOUND)

    def _require_dispatchable(self) -> None:
        if self._phase in (SessionPhase.FINALIZING, SessionPhase.CLOSED):
            raise SessionClosedError(
                f"session {self.key!r} is {self._phase.value}; no new dispatch",
                session=self.key,
                phase=self._phase.value,
            )

    # --- dispatch --------------------------------------------------------------------------------
    # The per-route methods hand back :meth:`dispatch`'s own coroutine (awaited by the caller):
    # no frame of their own on a path every turn takes.

    def generate(self, request: RequestLike) -> Coroutine[Any, Any, EngineReply]:
        """SGLang ``/generate`` with this Session's version (binds on the first call)."""
        return self.dispatch(Route.GENERATE, request)

    def chat_completions(self, request: RequestLike) -> Coroutine[Any, Any, EngineReply]:
        """OpenAI ``/v1/chat/completions`` with this Session's version."""
        return self.dispatch(Route.CHAT_COMPLETIONS, request)

    def completions(self, request: RequestLike) -> Coroutine[Any, Any, EngineReply]:
        """OpenAI ``/v1/completions`` with this Session's version."""
        return self.dispatch(Route.COMPLETIONS, request)

    def _body(self, route: Route, request: RequestLike) -> dict[str, Any]:
        # The fields this Session reads are checked (a one-shot and a streamed turn alike);
        # sampling values are the engine's to judge (a bad one is a 4xx: refused, never resent).
        body = request_body(route, request, validate=False)
        if self._binder.validate:
            check_shape(route, body)
        return body

    async def dispatch(self, route: Route, request: RequestLike) -> EngineReply:
        """Send one request down the chain: exactly one attempt, failures classified.

        A tool turn, a retry after an error and a resume after :meth:`abort` are all just another
        dispatch: they carry the same bound version and never read the default again.
        """
        self._require_dispatchable()
        binder = self._binder
        body = self._body(route, request)
        turn = (
            binder.turn(route, body)
            if binder.ready
            else await binder.before_send(route, body, self._require_dispatchable)
        )
        flight = self._flight_started(body)
        try:
            reply = await self._rt.chain(
                EngineCall(
                    route=route,
                    body=body,
                    session_key=self.key,
                    binding=turn.binding if turn is not None else None,
                    ticket=flight,
                )
            )
        finally:
            self._flight_ended(flight)
        return binder.after_reply(reply, turn)

    async def stream(self, route: Route, request: RequestLike) -> AsyncGenerator[StreamChunk, None]:
        """Send one request down the chain as a stream: its chunks, each naming this Session's
        version (:attr:`StreamChunk.provenance <agentic_lora.session.streaming.StreamChunk>`).

        The request holds its version (in-flight count, drain, close) until the stream ends or
        the iterator is closed; closing it early (``aclose``, cancellation) aborts
        the engine request by id where the engine can, else closes its connection. A failure
        before the first chunk is refused or indeterminate as in :meth:`dispatch`; after it,
        RequestIndeterminateError, raised once the chunks before it were read. Never resent.
        """
        self._require_dispatchable()
        chain = self._rt.stream_chain
        if chain is None:
            raise SessionStateError("this Session's manager has no streaming chain")
        binder = self._binder
        body = self._body(route, request)
        body.pop("stream", None)  # this call always streams; the dialect asks for it below
        turn = await binder.before_send(route, body, self._require_dispatchable)
        body = self._rt.dialect.stream_body(route, body)
        flight = self._flight_started(body)
        binding = turn.binding if turn is not None else None
        upstream = UpstreamStream(
            chain,
            EngineCall(route, body, self.key, binding, ticket=flight),
            self._rt.transport,
            can_abort=self._rt.dialect.can_abort,
        )
        provenance: TurnProvenance | None = None
        path = route.value  # an enum's value is a property call: once, not per chunk
        engine = ""
        first = True
        try:
            async for data in upstream:
                if first:
                    # Routed by now, and never again: the engine is the stream's for its life.
                    engine = flight.engine or ""
                    # The turn's lag is recorded once, at its first chunk (as at a reply).
                    head = EngineReply(engine, path, 200, None, flight.rid)
                    provenance = binder.after_reply(head, turn).provenance
                    first = False
                yield StreamChunk(engine, path, data, flight.rid, provenance)
        finally:
            await upstream.aclose(lambda: self._flight_ended(flight))

    def _flight_started(self, body: Mapping[str, Any]) -> InFlight:
        """The in-flight record of the request ``body`` is about to be sent (its ``rid``, for abort)."""
        rid = body.get("rid")
        flight = InFlight(rid=rid if isinstance(rid, str) else None)
        self._in_flight.add(flight)
        return flight

    def _flight_ended(self, flight: InFlight) -> None:
        in_flight = self._in_flight
        in_flight.discard(flight)
        if not in_flight and self._drained is not None:
            self._drained.set()

    async def _wait_drained(self) -> None:
        """Return at the first moment no request of this Session is in flight (now if none is)."""
        if not self._in_flight:
            return
        drained = self._drained
        if drained is None or drained.is_set():
            # A set event belongs to an earlier busy period. Made after the check with no await
            # since: the last request of this period to end finds it and sets it, so no waiter
            # can miss its wake-up; waiters of one period share it.
            drained = self._drained = asyncio.Event()
        await drained.wait()

    def provenance(self) -> dict[str, Any]:
        """This Session's trajectory provenance, JSON-able, for the trainer to store with it.

        ``version_id``, ``digest`` (full), ``lora_name`` and ``default_revision_at_bind`` are
        None before the first bind (and on a pass-through Session). ``rolled_back_from`` names
        the version a rollback replaced when the Session bound a default that rollback brought
        back (else None): its version is the rolled-back one. ``lags`` holds the lag of
        every turn that returned a reply, in reply order (None where the registry client could
        not say the current revision); ``turns`` is their count. ``too_stale_lag`` is the lag
        of the ``VERSION_TOO_STALE`` refusal that ended the Session's dispatching, else None.
        """
        return self._binder.provenance(self.session_id)

    async def abort(self, rid: str) -> bool:
        """Abort this Session's in-flight request ``rid`` on its engine; the binding stays.

        Returns False when no such request is in flight here (already ended, or not yet routed).
        The aborted request ends with ``finish_reason.type == "abort"``; resume by dispatching
        again, which carries the same adapter. On engines whose dialect cannot abort a request by
        id (vLLM), this raises InvalidRequestError and sends nothing.
        """
        dialect = self._rt.dialect
        if not dialect.can_abort:
            try:
                dialect.abort_request(rid)  # the dialect's own refusal, in its words
            except InvalidRequestError as exc:
                raise InvalidRequestError(exc.message, session=self.key, **exc.details) from exc
        for flight in list(self._in_flight):
            if flight.rid == rid and flight.engine is not None:
                await self._rt.transport.abort(flight.engine, rid)
                return True
        return False

    # --- close -----------------------------------------------------------------------------------

    async def close(self) -> ReleaseResult | None:
        """Finish this Session: refuse new dispatch, drain, release exactly once (see module doc).

        Idempotent: a closed Session returns its first result without calling the registry, and
        concurrent closes share one finalization. Raises SessionReleaseError if the release is not
        confirmed; the Session then stays FINALIZING and ``close()`` may be called again.
        """
        if self._phase is SessionPhase.CLOSED:
            return self._release_result
        task = self._close_task
        if task is None or task.done():
            if self._phase in (SessionPhase.OPEN, SessionPhase.BOUND):
                self._advance(SessionPhase.FINALIZING)
            if self._close_now():
                return self._release_result
            task = asyncio.get_running_loop().create_task(
                self._finalize(), name=f"close {self.key}"
            )
            self._close_task = task
        return await asyncio.shield(task)

    def _close_now(self) -> bool:
        """The whole close without an await, when nothing is left to wait for: no request in
        flight (nothing to abort or drain), no bind running, and a registry that answers at once.

        No await means no point at which a cancelled caller could cut the close short, so it needs
        no task of its own; and no other closer can be waiting (one would hold a close task).
        """
        close_now = self._rt.close_now
        if close_now is None or self._in_flight or not self._binder.bind_settled():
            return False
        done, result = close_now(self)
        if done:
            self._closed(result)
        return done

    async def _finalize(self) -> ReleaseResult | None:
        binder = self._binder
        await binder.begin_close()
        await binder.settle_bind()
        await self._abort_in_flight()
        if self._in_flight:
            logger.info(
                "close waits for in-flight requests to end",
                extra={"session": self.key, "in_flight": len(self._in_flight)},
            )
            self.close_waits.set()
            await self._wait_drained()
        self._closed(await binder.release())
        await self._rt.on_closed(self)
        return self._release_result

    def _closed(self, result: ReleaseResult | None) -> None:
        self._release_result = result
        self._advance(SessionPhase.CLOSED)
        if logger.isEnabledFor(logging.INFO):
            logger.info(
                "session closed",
                extra={
                    "session": self.key,
                    "version": result.version_id if result is not None else None,
                    "released_now": result.released_now if result is not None else None,
                },
            )

    async def _abort_in_flight(self) -> None:
        if not self._rt.dialect.can_abort:
            return  # no abort route: the drain that follows waits for them to end
        targets = [(f.engine, f.rid) for f in self._in_flight if f.engine and f.rid]
        for engine, rid in targets:
            try:
                await self._rt.transport.abort(engine, rid)
            except AgenticLoRAError as exc:
                # The request still ends (answer or client timeout); draining waits for it.
                logger.warning(
                    "abort on close failed",
                    extra={"session": self.key, "engine": engine, "rid": rid, "error": str(exc)},
                )
