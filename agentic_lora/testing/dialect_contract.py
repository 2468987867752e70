"""The contract every engine dialect keeps, as a reusable check.

::

    from agentic_lora.testing.dialect_contract import EngineAnswers, check_dialect

    await check_dialect(MyDialect(), EngineAnswers(live={...}, restarted={...}))

:func:`check_dialect` drives the dialect with no engine: a scripted
:class:`~agentic_lora.engines.wire.EngineHttp` (:class:`ScriptedHttp`) answers its reads with the
:class:`EngineAnswers` given (what one engine process of that kind answers, and what the same
engine answers after a restart). It raises AssertionError naming the broken rule:

1. it is an :class:`~agentic_lora.engines.dialect.EngineDialect`, registered under its ``name``;
2. ``check_route`` accepts exactly ``routes`` and refuses the rest (``route_unsupported``);
3. ``pin`` names the bound adapter on every route it serves, never edits the caller's body, is
   idempotent (a body it pinned pins to itself), and refuses a body naming another adapter in
   ``lora_path``, or in ``model`` on an OpenAI route (``ADAPTER_MISMATCH``);
4. ``abort_request`` gives a POST route carrying the request id when ``can_abort``, and refuses
   (``abort_unsupported``) otherwise;
5. ``read_server_info`` either reads nothing and answers None, or answers a mapping; an engine
   that answers 404 everywhere is a typed refusal, never a silent None; a transport failure is
   never swallowed;
6. ``fingerprint`` is stable for one process and changes across a restart;
7. ``stream_body`` asks for a stream without editing the caller's body or its adapter, and
   ``parse_stream_event`` reads a chunk, the engine's error object and ``[DONE]`` apart.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field
from typing import Any

from agentic_lora.engines.dialect import EngineDialect
from agentic_lora.engines.dialect import SlotSettings
from agentic_lora.engines.dialect import load_dialect
from agentic_lora.engines.sse import StreamEventKind
from agentic_lora.engines.wire import HttpAnswer
from agentic_lora.engines.wire import Outcome
from agentic_lora.errors import AdapterMismatchError
from agentic_lora.errors import InvalidRequestError
from agentic_lora.foundation.requests import Route

__all__ = ["EngineAnswers", "Judged", "ScriptedHttp", "WireFailure", "check_dialect"]

LORA = "policy_lora@0-v1-0123456789abcdef"
OTHER = "policy_lora@0-v2-fedcba9876543210"
BASE = "base-model"
BASE_URL = "http://127.0.0.1:30000"

#: A minimal body per route (the Session validates bodies before the pin; these pass).
_BODIES: Mapping[Route, dict[str, Any]] = {
    Route.GENERATE: {"text": "x", "sampling_params": {"max_new_tokens": 1}},
    Route.COMPLETIONS: {"prompt": "x", "max_tokens": 1},
    Route.CHAT_COMPLETIONS: {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1},
}


class Judged(Exception):
    """What :class:`ScriptedHttp` builds for an answer the dialect judged a failure."""

    def __init__(self, message: str, outcome: Outcome, details: Mapping[str, Any]) -> None:
        super().__init__(message)
        self.outcome = outcome
        self.details = dict(details)


class WireFailure(Exception):
    """A transport failure :class:`ScriptedHttp` raises when told to."""


@dataclass
class ScriptedHttp:
    """An :class:`~agentic_lora.engines.wire.EngineHttp` answering from a path table (404 for
    the rest), recording every GET; ``lost`` makes every GET a :class:`WireFailure`."""

    answers: Mapping[str, HttpAnswer] = field(default_factory=dict)
    lost: bool = False
    calls: list[str] = field(default_factory=list)

    @property
    def engine(self) -> str:
        return "e0"

    async def get_answer(self, op: str, path: str) -> HttpAnswer:
        self.calls.append(path)
        if self.lost:
            raise WireFailure(f"{op}: reply lost")
        return self.answers.get(path, HttpAnswer(404, {"detail": "Not Found"}, "Not Found"))

    def failure(self, outcome: Outcome, op: str, message: str, **details: Any) -> Exception:
        return Judged(f"{op}: {message}", outcome, details)


@dataclass(frozen=True)
class EngineAnswers:
    """What one engine of the dialect's kind answers (``live``), and after a restart."""

    live: Mapping[str, HttpAnswer]
    restarted: Mapping[str, HttpAnswer]


def _names_adapter(body: Mapping[str, Any], lora: str) -> bool:
    return lora in json.dumps(body)


def _check_pin(dialect: EngineDialect) -> None:
    for route in dialect.routes:
        given = dict(_BODIES[route])
        before = json.dumps(given, sort_keys=True)
        out = dialect.pin(route, given, LORA, BASE)
        assert json.dumps(given, sort_keys=True) == before, f"pin edited the caller's {route}"
        assert _names_adapter(out, LORA), f"pin does not name the adapter on {route}: {out}"
        assert dialect.pin(route, out, LORA, BASE) == out, f"pin is not idempotent on {route}"
        assert not _names_adapter(dialect.pin(route, given, OTHER, BASE), LORA)
        wrongs: list[dict[str, Any]] = [{"lora_path": OTHER}]
        if route.is_openai:  # ``model`` names the adapter only on the OpenAI routes
            wrongs += [{"model": OTHER}, {"model": f"{BASE}:{OTHER}"}]
        for wrong in wrongs:
            try:
                dialect.pin(route, {**given, **wrong}, LORA, BASE)
            except AdapterMismatchError:
                continue
            raise AssertionError(f"pin accepted {wrong} for a Session bound to {LORA} on {route}")


def _check_routes(dialect: EngineDialect) -> None:
    assert dialect.routes, "a dialect serves at least one route"
    for route in Route:
        if route in dialect.routes:
            dialect.check_route(route)
            continue
        reason = None
        try:
            dialect.check_route(route)
        except InvalidRequestError as exc:
            reason = exc.details.get("reason")
        assert reason == "route_unsupported", f"check_route on {route} (not served): {reason}"


def _check_abort(dialect: EngineDialect) -> None:
    if dialect.can_abort:
        path, body = dialect.abort_request("rid-7")
        assert path.startswith("/"), path
        assert "rid-7" in json.dumps(body), f"the abort body does not carry the id: {body}"
        return
    reason = None
    try:
        dialect.abort_request("rid-7")
    except InvalidRequestError as exc:
        reason = exc.details.get("reason")
    assert reason == "abort_unsupported", f"can_abort is False but abort_request: {reason}"


async def _check_server_info(dialect: EngineDialect, answers: EngineAnswers) -> None:
    live = ScriptedHttp(answers.live)
    info = await dialect.read_server_info(live)
    if info is None:
        assert live.calls == [], f"read_server_info answered None after reading {live.calls}"
    else:
        assert isinstance(info, Mapping), info
        outcome = None
        try:
            await dialect.read_server_info(ScriptedHttp({}))
        except Judged as exc:
            outcome = exc.outcome
        assert outcome is Outcome.REFUSED, f"server info of an engine answering 404: {outcome}"
        try:
            await dialect.read_server_info(ScriptedHttp(answers.live, lost=True))
        except WireFailure:
            pass
        else:
            raise AssertionError("read_server_info swallowed a transport failure")
        # The slot check runs on what the reader answered, and passes for a roomy engine.
        dialect.check_server_info(info, engine="e0", slots=SlotSettings(capacity=1))


async def _check_fingerprint(dialect: EngineDialect, answers: EngineAnswers) -> None:
    first = await dialect.fingerprint(ScriptedHttp(answers.live), BASE_URL)
    again = await dialect.fingerprint(ScriptedHttp(answers.live), BASE_URL)
    later = await dialect.fingerprint(ScriptedHttp(answers.restarted), BASE_URL)
    assert isinstance(first, str), first
    assert first, "an empty fingerprint"
    assert first == again, "the fingerprint of one process changed between two reads"
    assert first != later, "the fingerprint did not change across a restart"
    try:
        await dialect.fingerprint(ScriptedHttp(answers.live, lost=True), BASE_URL)
    except WireFailure:
        pass
    else:
        raise AssertionError("fingerprint swallowed a transport failure")


def _check_stream(dialect: EngineDialect) -> None:
    for route in dialect.routes:
        given = dialect.pin(route, _BODIES[route], LORA, BASE)
        before = dict(given)
        streamed = dialect.stream_body(route, given)
        assert given == before, f"stream_body edited the caller's body on {route.value}"
        assert streamed.get("stream") is True, f"stream_body does not ask for a stream: {streamed}"
        assert _names_adapter(streamed, LORA), f"stream_body lost the adapter: {streamed}"
    kinds = [
        dialect.parse_stream_event(payload).kind
        for payload in ('{"choices": []}', '{"error": {"message": "x", "code": 400}}', "[DONE]")
    ]
    assert kinds == [StreamEventKind.CHUNK, StreamEventKind.ERROR, StreamEventKind.DONE], kinds


async def check_dialect(dialect: EngineDialect, answers: EngineAnswers) -> None:
    """Run every rule of the module docstring against ``dialect``; AssertionError if one fails."""
    assert isinstance(dialect, EngineDialect), f"{dialect!r} is not an EngineDialect"
    assert type(load_dialect(dialect.name)) is type(dialect), (
        f"{dialect.name!r} is not registered as {type(dialect).__name__} in agentic_lora.engines"
    )
    assert isinstance(dialect.unload_waits_for_requests, bool)
    _check_routes(dialect)
    _check_pin(dialect)
    _check_abort(dialect)
    _check_stream(dialect)
    await _check_server_info(dialect, answers)
    await _check_fingerprint(dialect, answers)
