"""The engine HTTP client: one attempt per generation, every failure classified.

One :class:`EngineTransport` holds one HTTP stack for the whole engine set
(:mod:`agentic_lora.engines.stacks`): aiohttp used directly by default, or httpx (what respx mocks,
and the fallback without aiohttp). The stack carries bytes; everything here decides what they mean.

Nothing here sends a generation twice. The HTTP layer has no retries, aiohttp never re-sends a
POST on a reused connection, and :meth:`EngineTransport.send` calls the exchange exactly once, with
no retry loop around it. The rule is written down as a stop condition, :data:`GENERATION_STOP`
(one attempt), so a test can read it; the send implements it by construction.
Whether to generate again is the caller's decision, made with the classification:

* :class:`~agentic_lora.errors.RequestRefusedError`: the engine provably did not accept the
  request (the connection was never established, or the engine answered 4xx);
* :class:`~agentic_lora.errors.RequestIndeterminateError`: it may have (a timeout or reset after
  the request went out, a 5xx, an unreadable reply).

The classification is :mod:`agentic_lora.engines.wire`'s (the admin clients use the same table).
Control-plane calls (abort by id, server info; their routes are the engine dialect's, see
:mod:`agentic_lora.engines.dialect`) are idempotent, so they alone are retried, a bounded number of
times, and the retry policy is entered only after a first attempt failed
(:func:`agentic_lora.foundation.replay.after_failure`).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator
from collections.abc import Coroutine
from collections.abc import Mapping
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from tenacity import AsyncRetrying
from tenacity import retry_if_exception
from tenacity import stop_after_attempt
from tenacity import wait_exponential
from tenacity.stop import stop_base
from tenacity.wait import wait_base

from agentic_lora.engines.backends import EngineRef
from agentic_lora.engines.dialect import EngineDialect
from agentic_lora.engines.sglang import SGLANG
from agentic_lora.engines.sse import data_payload
from agentic_lora.engines.stack_choice import make_stack
from agentic_lora.engines.stacks import StackAnswer
from agentic_lora.engines.wire import WIRE_ERRORS
from agentic_lora.engines.wire import EngineHttp
from agentic_lora.engines.wire import HttpAnswer
from agentic_lora.engines.wire import HttpTransportKind
from agentic_lora.engines.wire import Outcome
from agentic_lora.engines.wire import ReplyTooDeepError
from agentic_lora.engines.wire import classify_exception
from agentic_lora.engines.wire import classify_status
from agentic_lora.engines.wire import decode_content
from agentic_lora.errors import ConfigurationError
from agentic_lora.errors import DispatchError
from agentic_lora.errors import InvalidRequestError
from agentic_lora.errors import RequestIndeterminateError
from agentic_lora.errors import RequestRefusedError
from agentic_lora.errors import UnknownEngineError
from agentic_lora.foundation.http_limits import ENGINE_KEEPALIVE_EXPIRY
from agentic_lora.foundation.http_limits import engine_limits
from agentic_lora.foundation.replay import after_failure
from agentic_lora.registry.provenance import TurnProvenance

__all__ = [
    "GENERATION_STOP",
    "EngineReply",
    "EngineTransport",
    "HttpTransportKind",
    "Outcome",
    "classify_exception",
    "classify_status",
]

logger = logging.getLogger(__name__)

#: The generation retry policy: one attempt, never a second.
GENERATION_STOP: stop_base = stop_after_attempt(1)


@dataclass(frozen=True, slots=True)
class EngineReply:
    """One engine answer: where it came from, its status and its decoded body.

    ``provenance``: set by a versioned Session on every reply it returns (which version answered,
    and its lag when the turn started; see :mod:`agentic_lora.registry.provenance`); None below the
    Session and on pass-through Sessions.
    """

    engine: str
    path: str
    status_code: int
    body: Any
    rid: str | None = None
    provenance: TurnProvenance | None = None

    def with_provenance(self, provenance: TurnProvenance) -> EngineReply:
        """This reply with ``provenance`` attached (the other fields unchanged)."""
        # The constructor, not dataclasses.replace: this runs once per versioned reply, and
        # replace costs several times more (it walks the fields by name). Keep it in step with
        # the fields above.
        return EngineReply(
            self.engine, self.path, self.status_code, self.body, self.rid, provenance
        )

    @property
    def finish_reason(self) -> Mapping[str, Any] | None:
        """SGLang's ``meta_info.finish_reason`` when the body has one."""
        if isinstance(self.body, Mapping):
            meta = self.body.get("meta_info")
            if isinstance(meta, Mapping):
                reason = meta.get("finish_reason")
                if isinstance(reason, Mapping):
                    return reason
        return None

    @property
    def aborted(self) -> bool:
        """The engine ended this request by abort (e.g. ``/abort_request``)."""
        reason = self.finish_reason
        return reason is not None and reason.get("type") == "abort"


# One encoder for every body: ``json.dumps`` with any non-default option builds a new
# JSONEncoder per call. Its options never change and ``encode`` keeps no state between calls, so
# sharing it is safe across tasks (and the bytes are the same as ``json.dumps`` with these options).
_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def _encode(body: Mapping[str, Any]) -> bytes:
    # Before anything is sent: a body JSON cannot carry (NaN, Infinity, odd types) is refused.
    try:
        return _ENCODER.encode(body).encode()
    except (TypeError, ValueError, RecursionError) as exc:
        # RecursionError: nested deeper than the encoder's stack (a caller's own dict can be).
        raise InvalidRequestError(
            f"the request body cannot be sent as JSON: {exc}", reason="not_json"
        ) from exc


def _where(engine: str, path: str, rid: object) -> dict[str, Any]:
    """The details every failure of one exchange names (built only when one is raised)."""
    return {"engine": engine, "path": path, "rid": rid}


async def _close_quietly(answer: StackAnswer, engine: str, path: str, rid: object) -> None:
    # Runs at a stream's end or while a failure is raised: a failed close must replace neither.
    try:
        await answer.close()
    except WIRE_ERRORS as exc:
        logger.debug(
            "closing an engine response failed",
            extra={**_where(engine, path, rid), "error": type(exc).__name__},
        )


async def _payloads(answer: StackAnswer, where: Mapping[str, Any]) -> AsyncIterator[str]:
    # Only the ``data:`` payloads go up: every event the engines stream is one ``data:`` line,
    # so the blank line after each and any comment carry nothing, and passing them through two
    # more async iterators cost the reader a hop per line (half of all lines).
    try:
        async for line in answer.lines():
            payload = data_payload(line)
            if payload is not None:
                yield payload
    except WIRE_ERRORS as exc:
        raise _failure(
            Outcome.INDETERMINATE,
            f"streamed reply lost while reading it ({type(exc).__name__}); the engine ran "
            "the request",
            error=type(exc).__name__,
            **where,
        ) from exc


def _unanswered(
    exc: BaseException, label: str, engine: str, path: str, rid: object
) -> DispatchError:
    """The classified failure of an exchange whose answer never came (see :meth:`_open`)."""
    outcome = classify_exception(exc)
    sent = "was not sent" if outcome is Outcome.REFUSED else "may have been accepted"
    return _failure(
        outcome,
        f"{label} to {engine}: {type(exc).__name__} ({exc}); the request {sent} and is not resent",
        error=type(exc).__name__,
        **_where(engine, path, rid),
    )


def _failure(
    outcome: Outcome,
    message: str,
    **details: Any,
) -> DispatchError:
    cls = RequestRefusedError if outcome is Outcome.REFUSED else RequestIndeterminateError
    return cls(f"{message} [{outcome.value}]", outcome=outcome.value, **details)


class EngineTransport:
    """HTTP access to a fixed set of engines (see module docstring)."""

    def __init__(
        self,
        engines: Sequence[EngineRef],
        *,
        request_timeout: float = 600.0,
        connect_timeout: float = 5.0,
        http_transport: HttpTransportKind = "aiohttp",
        max_connections: int = 512,
        keepalive_expiry: float = ENGINE_KEEPALIVE_EXPIRY,
        control_attempts: int = 3,
        control_wait: wait_base | None = None,
        dialect: EngineDialect = SGLANG,
    ) -> None:
        if not engines:
            raise ConfigurationError(
                "an engine transport needs at least one engine", check="empty_fleet"
            )
        names = [e.name for e in engines]
        if len(set(names)) != len(names):
            raise ConfigurationError(f"duplicate engine names in {names}", check="duplicate_engine")
        if control_attempts < 1:
            raise ConfigurationError(
                "control_attempts must be at least 1", check="control_attempts"
            )
        self._engines: dict[str, EngineRef] = {e.name: e for e in engines}
        timeout = httpx.Timeout(request_timeout, connect=connect_timeout, pool=connect_timeout)
        limits = engine_limits(
            max_connections, keepalive_expiry
        )  # see agentic_lora.foundation.http_limits
        self._stack = make_stack(http_transport, timeout, limits)
        self._control_attempts = control_attempts
        self._control_wait: wait_base = (
            control_wait if control_wait is not None else wait_exponential(multiplier=0.05, max=1.0)
        )
        self._dialect = dialect
        self._closed = False

    @property
    def dialect(self) -> EngineDialect:
        """The engine dialect: the routes of abort and server info."""
        return self._dialect

    @property
    def engines(self) -> tuple[EngineRef, ...]:
        """The fixed engine set, in the order given."""
        return tuple(self._engines.values())

    @property
    def http_transport(self) -> HttpTransportKind:
        """The HTTP stack actually in use (``"httpx"`` after a fallback)."""
        return self._stack.kind

    @property
    def generation_stop(self) -> stop_base:
        """The stop condition of the generation policy (always :data:`GENERATION_STOP`)."""
        return GENERATION_STOP

    def _ref(self, engine: str) -> EngineRef:
        ref = self._engines.get(engine)
        if ref is None:
            raise UnknownEngineError(
                f"engine {engine!r} is not in the fleet {list(self._engines)}", engine=engine
            )
        return ref

    async def _open(
        self,
        engine: str,
        method: str,
        path: str,
        content: bytes | None,
        rid: object,
        label: str,
    ) -> StackAnswer:
        """Send once and return the answer whose head is in; a failure before the head is
        classified (RequestRefusedError: not sent; RequestIndeterminateError: may have run)."""
        base_url = self._ref(engine).base_url
        try:
            # Inside the try: a URL that cannot be requested fails here, before sending.
            return await self._stack.open(method, base_url, path, content)
        except WIRE_ERRORS as exc:
            raise _unanswered(exc, label, engine, path, rid) from exc

    async def _exchange(
        self,
        engine: str,
        method: str,
        path: str,
        content: bytes | None,
        rid: str | None,
        *,
        check_status: bool = True,
    ) -> EngineReply:
        """One HTTP exchange, classified. Raises RequestRefusedError/RequestIndeterminateError
        (``check_status=False``: only for what happened on the wire; any answer is returned)."""
        base_url = self._ref(engine).base_url
        try:
            answer = await self._stack.open(method, base_url, path, content)
        except WIRE_ERRORS as exc:
            raise _unanswered(exc, f"{method} {path}", engine, path, rid) from exc
        status = answer.status
        try:
            # A body read in full releases its answer (the stack's contract): only a read cut
            # short (a failure, a cancellation) leaves one to close.
            data = await answer.read()
        except BaseException as exc:
            await _close_quietly(answer, engine, path, rid)
            if not isinstance(exc, WIRE_ERRORS):
                raise
            # The engine answered, so it has the request: only a 4xx still proves refusal
            # (a body cut off, or in a content-encoding that cannot be decoded).
            if classify_status(status) is Outcome.REFUSED:
                refused = f"{method} {path} to {engine} refused with HTTP {status}"
                where = _where(engine, path, rid)
                raise _failure(Outcome.REFUSED, refused, status=status, **where) from exc
            raise _failure(
                Outcome.INDETERMINATE,
                f"{method} {path} to {engine}: reply lost while reading it "
                f"({type(exc).__name__}); the engine may have run the request",
                status=status,
                error=type(exc).__name__,
                **_where(engine, path, rid),
            ) from exc
        try:
            body = decode_content(status, data, answer.charset)
        except ReplyTooDeepError as exc:
            # Passed on as text it would reach the caller as another value than the engine's.
            outcome = classify_status(status) or Outcome.INDETERMINATE
            raise _failure(
                outcome,
                f"{method} {path} to {engine}: {exc}",
                status=status,
                reason="reply_not_json",
                **_where(engine, path, rid),
            ) from exc
        status_outcome = classify_status(status) if check_status else None
        if status_outcome is not None:
            what = "refused" if status_outcome is Outcome.REFUSED else "failed and may have run"
            raise _failure(
                status_outcome,
                f"{method} {path} to {engine} {what}: HTTP {status}",
                status=status,
                body=body,
                **_where(engine, path, rid),
            )
        return EngineReply(engine, path, status, body, rid)

    # Hands back the exchange's own coroutine (one frame less per generation); a refusal before
    # anything is sent (closed, a body JSON cannot carry) is raised at the call, as the pin does.
    def send(
        self, engine: str, path: str, body: Mapping[str, Any]
    ) -> Coroutine[Any, Any, EngineReply]:
        """POST one generation to ``engine``: exactly one attempt, failures classified."""
        if self._closed:
            raise RequestRefusedError("the engine transport is closed", engine=engine, path=path)
        given_rid = body.get("rid")
        rid = given_rid if isinstance(given_rid, str) else None
        # Exactly one attempt by construction: one call, no loop (GENERATION_STOP is the rule
        # this implements; a retry policy around it cost more CPU than the exchange itself).
        return self._exchange(engine, "POST", path, _encode(body), rid)

    @contextlib.asynccontextmanager
    async def open_stream(
        self, engine: str, path: str, body: Mapping[str, Any]
    ) -> AsyncIterator[AsyncIterator[str]]:
        """POST one streamed generation to ``engine`` (one attempt); yields an iterator of its
        server-sent events' ``data:`` payloads (:mod:`agentic_lora.engines.sse`; blank lines and
        comments are skipped).

        Until the answer's head is in, failures are classified as :meth:`send` classifies them,
        and a non-2xx answer is read and raised the same way. A failure while the payloads are read
        is RequestIndeterminateError (the engine answered, so it had the request). On exit the
        answer is closed: one not read to its end closes its connection, which is how an engine
        without abort by id learns that nobody reads the request any more.
        """
        if self._closed:
            raise RequestRefusedError("the engine transport is closed", engine=engine, path=path)
        rid = body.get("rid")
        answer = await self._open(
            engine, "POST", path, _encode(body), rid, f"POST {path} (streamed)"
        )
        where = _where(engine, path, rid)
        try:
            status = answer.status
            outcome = classify_status(status)
            if outcome is not None:
                error_body: Any = None
                with contextlib.suppress(*WIRE_ERRORS, ReplyTooDeepError):
                    error_body = decode_content(status, await answer.read(), answer.charset)
                raise _failure(
                    outcome,
                    f"POST {path} (streamed) to {engine} answered HTTP {status}",
                    status=status,
                    body=error_body,
                    **where,
                )
            yield _payloads(answer, where)
        finally:
            await _close_quietly(answer, engine, path, rid)

    def _control_policy(self) -> AsyncRetrying:
        def retryable(exc: BaseException) -> bool:
            # A 4xx is the engine's answer; asking again changes nothing.
            if isinstance(exc, RequestRefusedError):
                return exc.details.get("status") is None
            return isinstance(exc, RequestIndeterminateError)

        return AsyncRetrying(
            stop=stop_after_attempt(self._control_attempts),
            wait=self._control_wait,
            retry=retry_if_exception(retryable),
            reraise=True,
        )

    async def abort(self, engine: str, rid: str) -> None:
        """Ask ``engine`` to abort request ``rid`` (idempotent: retried on transport failures).

        The route is the dialect's (:meth:`~agentic_lora.engines.dialect.EngineDialect.abort_request`;
        InvalidRequestError, nothing sent, when the engine cannot abort by id). SGLang answers 200
        whether or not the request is still running; the request itself then ends with
        ``finish_reason.type == "abort"``.
        """
        path, payload = self._dialect.abort_request(rid)
        content = _encode(payload)
        await after_failure(
            lambda: self._exchange(engine, "POST", path, content, rid), self._control_policy
        )
        logger.info("abort sent", extra={"engine": engine, "rid": rid})

    async def server_info(self, engine: str) -> Mapping[str, Any] | None:
        """The engine's server info as its dialect reads it (None: the engine publishes none)."""
        return await self._dialect.read_server_info(self.engine_http(engine))

    def engine_http(self, engine: str) -> EngineHttp:
        """``engine`` as a dialect reads it: idempotent GETs, lost replies asked again."""
        self._ref(engine)
        return _ControlHttp(self, engine)

    async def _control_get(self, engine: str, path: str) -> HttpAnswer:
        if self._closed:
            raise RequestRefusedError("the engine transport is closed", engine=engine, path=path)

        async def get() -> EngineReply:
            reply = await self._exchange(engine, "GET", path, None, None, check_status=False)
            if classify_status(reply.status_code) is Outcome.INDETERMINATE:
                # A 5xx may be the engine's passing trouble: asked again, like a lost reply.
                raise _failure(
                    Outcome.INDETERMINATE,
                    f"GET {path} to {engine} failed: HTTP {reply.status_code}",
                    status=reply.status_code,
                    body=reply.body,
                    engine=engine,
                    path=path,
                )
            return reply

        reply = await after_failure(get, self._control_policy)
        body = reply.body
        text = body if isinstance(body, str) else "" if body is None else json.dumps(body)
        return HttpAnswer(reply.status_code, reply.body, text)

    async def aclose(self) -> None:
        """Close the HTTP stack (idempotent)."""
        if not self._closed:
            self._closed = True
            await self._stack.aclose()

    async def __aenter__(self) -> EngineTransport:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


class _ControlHttp:
    """One engine of an :class:`EngineTransport`, as an :class:`EngineHttp`."""

    def __init__(self, transport: EngineTransport, engine: str) -> None:
        self._transport = transport
        self._engine = engine

    @property
    def engine(self) -> str:
        return self._engine

    async def get_answer(self, op: str, path: str) -> HttpAnswer:
        return await self._transport._control_get(self._engine, path)

    def failure(self, outcome: Outcome, op: str, message: str, **details: Any) -> Exception:
        return _failure(
            outcome, f"{op} of {self._engine}: {message}", engine=self._engine, **details
        )
