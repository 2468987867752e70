"""The Session gateway, continued: malformed requests, the idle-Session expiry loop, shutdown
with a publication in flight, what the admin client makes of a peer that is not (or no longer)
an agentic-lora gateway, and the wire helpers every error answer goes through.

The gateway runs for real over scripted engines (``gateway_stack`` from ``test_gateway.py``).
Where the admin client must meet a broken peer (a proxy answering HTML, a stream cut off), the
peer is an ``httpx.MockTransport``: the edge of the client under test.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentic_lora.errors import (
    AgenticLoRAError,
    ConfigurationError,
    JournalCorruptError,
    NoPublishedVersionError,
    RequestIndeterminateError,
    RequestRefusedError,
    SessionReleaseError,
    VersionConflictError,
)
from agentic_lora.gateway.app import Gateway
from agentic_lora.gateway.client import AdminClient
from agentic_lora.gateway.progress import ProgressHub
from agentic_lora.gateway.sessions import MAX_SESSION_ID_LENGTH, IdleReaped
from agentic_lora.gateway.wire import (
    NDJSON,
    error_payload,
    http_status,
    jsonable,
    should_retry,
)
from agentic_lora.publication.publisher import Phase, PhaseEvent, PhaseStatus
from agentic_lora.session import SessionPhase
from agentic_lora.testing.fleet import ScriptedFleet
from agentic_lora.testing.sglang_engine import EngineOp, Fault, FaultKind
from tests.test_gateway import (
    ADMIN_TOKEN,
    FakeClock,
    chat,
    gateway_stack,
    settings_for,
)

ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}


# --- malformed requests -------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_malformed_bodies_and_ids_are_400s_that_never_reach_an_engine(
    tmp_path: Path,
) -> None:
    async with gateway_stack(tmp_path) as stack:
        await stack.publish("A", 1)
        http = stack.http()
        generations = stack.fleet.calls(EngineOp.GENERATE)

        listed = await http.post("/generate", json=[1, 2], headers={"x-agentic-session": "s1"})
        assert listed.status_code == 400
        assert listed.json()["error"] == {
            "code": "INVALID_REQUEST",
            "message": "the body must be a JSON object",
            "details": {"route": "/generate", "reason": "not_object"},
        }
        assert listed.headers["x-agentic-outcome"] == "refused"

        too_long = "s" * (MAX_SESSION_ID_LENGTH + 1)
        long_id = await http.post(
            "/v1/completions", json={"prompt": "x"}, headers={"x-agentic-session": too_long}
        )
        assert long_id.status_code == 400
        error = long_id.json()["error"]
        assert error["details"] == {"reason": "bad_session_id"}
        assert f"longer than {MAX_SESSION_ID_LENGTH} characters" in error["message"]
        # The longest allowed id is a Session like any other.
        longest = "s" * MAX_SESSION_ID_LENGTH
        ok = await http.post(
            "/generate", json={"text": "x"}, headers={"x-agentic-session": longest}
        )
        assert ok.status_code == 200
        assert ok.headers["x-agentic-version"] == "A"

        assert stack.fleet.calls(EngineOp.GENERATE) == generations + 1
        assert stack.gateway.versioning.get(too_long) is None


@pytest.mark.asyncio
async def test_publish_requests_without_both_fields_are_refused_before_any_transfer(
    tmp_path: Path,
) -> None:
    async with gateway_stack(tmp_path) as stack:
        http = stack.http()
        adapter = stack.adapter(1)
        for payload, field in (
            ({"adapter_dir": adapter}, "version_id"),
            ({"adapter_dir": adapter, "version_id": "  "}, "version_id"),
            ({"adapter_dir": 7, "version_id": "A"}, "adapter_dir"),
        ):
            response = await http.post("/admin/publish", json=payload, headers=ADMIN)
            assert response.status_code == 400
            assert response.json()["error"] == {
                "code": "INVALID_REQUEST",
                "message": f"`{field}` must be a non-empty string",
                "details": {"field": field},
            }
        not_object = await http.post("/admin/publish", json=["A"], headers=ADMIN)
        assert not_object.status_code == 400
        assert not_object.json()["error"]["message"] == "the body must be a JSON object"
        assert stack.fleet.calls(EngineOp.LOAD) == 0
        assert (await stack.admin().status())["registry"]["versions"] == []


@pytest.mark.asyncio
@pytest.mark.parametrize("value", [b"Infinity", b"NaN"])
async def test_a_body_with_a_non_finite_number_is_refused_as_invalid(
    tmp_path: Path, value: bytes
) -> None:
    # Python's JSON reader takes NaN; JSON cannot carry it to an engine: refused before sending.
    async with gateway_stack(tmp_path) as stack:
        await stack.publish("A", 1)
        generations = stack.fleet.calls(EngineOp.GENERATE)
        response = await stack.http().post(
            "/generate",
            content=b'{"text": "x", "extra": ' + value + b"}",
            headers={"x-agentic-session": "inf", "content-type": "application/json"},
        )
        assert stack.fleet.calls(EngineOp.GENERATE) == generations  # it never left
        assert response.headers["x-agentic-outcome"] == "refused"
        assert (response.status_code, response.json()["error"]["code"]) == (
            400,
            "INVALID_REQUEST",
        )


@pytest.mark.asyncio
async def test_an_engine_4xx_passes_through_and_is_not_retryable(tmp_path: Path) -> None:
    async with gateway_stack(tmp_path) as stack:
        await stack.publish("A", 1)
        for engine in stack.fleet.engines.values():
            engine.script(EngineOp.GENERATE, Fault(FaultKind.REFUSE, "prompt too long"))
        response = await stack.http().post(
            "/generate", json={"text": "x"}, headers={"x-agentic-session": "long"}
        )
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["code"] == "REQUEST_REFUSED"
        assert error["details"]["status"] == 400
        assert error["details"]["body"] == {"error": {"message": "prompt too long"}}
        assert response.headers["x-agentic-outcome"] == "refused"
        # The engine judged the request itself: the same request would be refused again.
        assert response.headers["x-should-retry"] == "false"


# --- construction -------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_gateway_settings_are_checked_before_anything_runs(tmp_path: Path) -> None:
    with ScriptedFleet() as fleet:
        with pytest.raises(ConfigurationError) as off:
            await Gateway.from_settings(
                settings_for(fleet, enable_versioned_lora_publication=False),
                backend_options={"store_root": str(tmp_path / "store")},
            )
        assert off.value.details["check"] == "flag"
        assert "--enable-versioned-lora-publication" in off.value.message

        async with gateway_stack(tmp_path) as stack:
            deployment = stack.gateway.deployment
            for options, check in (
                ({"idle_timeout": 0}, "idle_timeout"),
                ({"idle_timeout": -1.0}, "idle_timeout"),
                ({"admin_token": "   "}, "admin_token"),
            ):
                with pytest.raises(ConfigurationError) as bad:
                    Gateway(deployment, **options)
                assert bad.value.details["check"] == check
        # Only the stack's own start-up probes (incarnation reads) reached the engines: a refused
        # build loaded, generated and unloaded nothing.
        for op in (EngineOp.LOAD, EngineOp.GENERATE, EngineOp.UNLOAD):
            assert fleet.calls(op) == 0


@pytest.mark.asyncio
async def test_a_journal_that_is_not_a_database_fails_the_build_with_a_typed_error(
    tmp_path: Path,
) -> None:
    journal = tmp_path / "journal.sqlite"
    journal.write_bytes(b"this is not a registry journal" * 64)
    before = journal.read_bytes()
    with ScriptedFleet() as fleet:
        with pytest.raises(JournalCorruptError) as err:
            await Gateway.from_settings(
                settings_for(fleet, journal_path=str(journal)),
                backend_options={"store_root": str(tmp_path / "store")},
            )
        assert fleet.calls() == 0
    assert err.value.code == "JOURNAL_CORRUPT"
    assert "is not a readable SQLite database" in err.value.message
    assert journal.read_bytes() == before  # never overwritten


@pytest.mark.asyncio
async def test_without_metrics_the_metrics_route_is_a_typed_404(tmp_path: Path) -> None:
    async with gateway_stack(tmp_path, with_metrics=False) as stack:
        assert stack.gateway.metrics is None
        response = await stack.http().get("/metrics")
        assert response.status_code == 404
        assert response.json()["error"] == {
            "code": "CONFIG_ERROR",
            "message": "this gateway runs without metrics",
            "details": {"check": "metrics"},
        }


# --- shutdown -----------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_closing_the_gateway_lets_a_running_publication_finish(tmp_path: Path) -> None:
    async with gateway_stack(tmp_path) as stack:
        gate, reached = asyncio.Event(), asyncio.Event()
        stack.fleet["e1"].script(EngineOp.LOAD, Fault.waiting_for(gate, reached))
        publishing = asyncio.ensure_future(stack.publish("A", 1))
        await reached.wait()  # e1 holds the load: the publication is mid-flight

        closing = asyncio.ensure_future(stack.gateway.aclose())
        await asyncio.sleep(0)  # aclose runs up to its wait for the publication
        assert not closing.done()
        gate.set()
        await closing
        result = await publishing
        assert result["outcome"] == "PUBLISHED"
        name = result["lora_name"]
        assert all(e.holds(name) for e in stack.fleet.engines.values())


# --- resolving a blocked publication -----------------------------------------------------------


@pytest.mark.asyncio
async def test_the_resolve_route_needs_the_admin_token_and_frees_a_blocked_slot(
    tmp_path: Path,
) -> None:
    async with gateway_stack(tmp_path) as stack:
        # The route is what is tested: the background resolver would settle B on its own.
        await stack.gateway.deployment.resolver.stop()
        await stack.publish("A", 1)
        stack.fleet["e1"].script(EngineOp.LOAD, Fault(FaultKind.REFUSE, "no room"))
        stack.fleet["e0"].script(EngineOp.UNLOAD, Fault(FaultKind.UNREACHABLE))
        assert (await stack.publish("B", 2))["outcome"] == "BLOCKED"
        registry: Any = stack.gateway.deployment.registry
        http = stack.http()
        unloads = stack.fleet.calls(EngineOp.UNLOAD)
        for headers in ({}, {"authorization": "Bearer wrong"}):
            denied = await http.post("/admin/resolve", json={"version_id": "B"}, headers=headers)
            assert denied.status_code == 401
            assert denied.json()["error"]["code"] == "ACCESS_DENIED"
        empty_id = await http.post("/admin/resolve", json={"version_id": " "}, headers=ADMIN)
        assert empty_id.status_code == 400
        assert empty_id.json()["error"]["details"]["field"] == "version_id"
        unknown = await http.post("/admin/resolve", json={"version_id": "nope"}, headers=ADMIN)
        assert unknown.status_code == 404
        assert unknown.json()["error"]["code"] == "UNKNOWN_VERSION"
        assert stack.fleet.calls(EngineOp.UNLOAD) == unloads
        assert registry.peek_version("B").state.value == "ABORTED"

        answer = await http.post("/admin/resolve", json={"version_id": "B"}, headers=ADMIN)
        assert answer.status_code == 200
        body = answer.json()
        assert (body["resolved"], body["blocked"]) == (["B"], [])
        (result,) = body["results"]
        assert (result["version_id"], result["outcome"], result["ok"]) == (
            "B",
            "FAILED_CLEAN",
            False,
        )
        # e1 confirmed during the publication; only e0 was left, and it answered now.
        assert [(e["engine"], e["cleaned"]) for e in result["engines"]] == [("e0", True)]
        assert registry.peek_version("B").state.value == "FAILED_CLEAN"

        # Without a version (no body at all) everything blocked is resolved: nothing now.
        everything = await http.post("/admin/resolve", headers=ADMIN)
        assert everything.json() == {"results": [], "resolved": [], "blocked": []}
        again = await stack.admin().resolve("B")
        assert again["results"][0]["reason"] == "nothing to resolve: FAILED_CLEAN"
        assert (await stack.publish("C", 3))["outcome"] == "PUBLISHED"


# --- idle expiry --------------------------------------------------------------------------------


class ReadCountingClock(FakeClock):
    """A fake clock that also lets a test wait for its next reads (each reap round reads once)."""

    def __init__(self, fail_reads: int = 0) -> None:
        super().__init__()
        self.reads = 0
        self.fail_reads = fail_reads
        self._read = asyncio.Event()

    def __call__(self) -> float:
        self.reads += 1
        self._read.set()
        if self.fail_reads > 0:
            self.fail_reads -= 1
            raise OSError("clock source unavailable")
        return self.now

    async def reads_after(self, count: int) -> None:
        target = self.reads + count
        while self.reads < target:
            self._read.clear()
            await self._read.wait()


@pytest.mark.asyncio
async def test_the_expiry_loop_closes_idle_sessions_and_survives_a_failed_round(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = ReadCountingClock()
    # idle_timeout only paces the loop here; idleness is measured on the fake clock.
    async with gateway_stack(tmp_path, clock=clock, idle_timeout=0.004) as stack:
        await stack.publish("A", 1)
        await chat(stack.agent("sleepy"))
        await clock.reads_after(2)  # the loop runs, and the Session is not idle yet
        assert stack.gateway.versioning.get("sleepy") is not None

        clock.fail_reads = 1
        clock.now = 10.0
        with caplog.at_level(logging.ERROR, logger="agentic_lora.gateway.app"):
            # The failing round, then one whole round after it.
            await clock.reads_after(3)
        assert [r.getMessage() for r in caplog.records] == [
            "idle Session expiry failed; retried next round"
        ]
        assert stack.gateway.versioning.get("sleepy") is None
        assert stack.gateway.sessions.live() == 0
        version = stack.gateway.deployment.registry.peek_version("A")  # type: ignore[attr-defined]
        assert version.session_refs == 0

        refused = await stack.http().post(
            "/generate", json={"text": "x"}, headers={"authorization": "Bearer sleepy"}
        )
        assert refused.status_code == 409
        # The registry tombstoned the id: the same answer on every replica and after a restart.
        assert refused.json()["error"]["details"] == {"session": "sleepy", "reason": "closed"}


@pytest.mark.asyncio
async def test_reap_forgets_sessions_closed_elsewhere(tmp_path: Path) -> None:
    clock = FakeClock()
    async with gateway_stack(tmp_path, clock=clock) as stack:
        await stack.publish("A", 1)
        await chat(stack.agent("via-http"))
        assert stack.gateway.sessions.live() == 1
        # The Python API closes it, not the gateway.
        result = await stack.gateway.versioning.close_session("via-http")
        assert result is not None
        assert result.released_now
        clock.now = 1000.0
        assert await stack.gateway.sessions.reap_idle(1.0) == IdleReaped()
        assert stack.gateway.sessions.live() == 0


@pytest.mark.asyncio
async def test_an_idle_close_whose_release_fails_keeps_the_session_and_refuses_its_id(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock()
    # The registry becomes unavailable (closed under the gateway): no release can be confirmed,
    # and the shutdown reports the Session it could not release.
    stack_context = gateway_stack(tmp_path, clock=clock)
    stack = await stack_context.__aenter__()
    try:
        await stack.publish("A", 1)
        await chat(stack.agent("stuck"))
        registry: Any = stack.gateway.deployment.registry
        await registry.aclose()
        clock.now = 1000.0
        with caplog.at_level(logging.WARNING, logger="agentic_lora.gateway.sessions"):
            assert await stack.gateway.sessions.reap_idle(1.0) == IdleReaped()
        (record,) = [r for r in caplog.records if r.name == "agentic_lora.gateway.sessions"]
        assert record.getMessage() == "idle Session close not confirmed; retried next round"
        assert getattr(record, "error") == "SESSION_RELEASE_FAILED"  # noqa: B009
        session = stack.gateway.versioning.get("stuck")
        assert session is not None
        assert session.phase is SessionPhase.FINALIZING
        assert stack.gateway.sessions.live() == 1
        # Its id is already refused: no straggler can open a fresh binding meanwhile.
        refused = await stack.http().post(
            "/generate", json={"text": "x"}, headers={"authorization": "Bearer stuck"}
        )
        assert refused.status_code == 409
        assert refused.json()["error"]["code"] == "SESSION_CLOSED"
        assert len(stack.routes.sent) == 1
    finally:
        # Shutting down reports the Session it could not release instead of dropping it.
        with pytest.raises(SessionReleaseError):
            await stack_context.__aexit__(None, None, None)


@pytest.mark.asyncio
async def test_closed_ids_are_remembered_by_the_registry_none_forgotten_by_count(
    tmp_path: Path,
) -> None:
    async with gateway_stack(tmp_path) as stack:
        sessions = stack.gateway.sessions
        for session_id in ("first", "second", "third"):
            await sessions.open(session_id)
            await sessions.close(session_id)
        # The gateway keeps nothing of them; the registry keeps every one (until name_ttl).
        assert sessions.live() == 0
        for session_id in ("first", "second", "third"):
            with pytest.raises(AgenticLoRAError) as err:
                await sessions.open(session_id)
            assert err.value.code == "SESSION_CLOSED"
            assert err.value.details == {"session": session_id, "reason": "closed"}


# --- progress hub -------------------------------------------------------------------------------


def event(engine: str | None, phase: Phase = Phase.PREPARE) -> PhaseEvent:
    return PhaseEvent(engine=engine, phase=phase, status=PhaseStatus.DONE, version_id="A")


def test_a_listener_hears_only_its_block_and_a_broken_one_starves_no_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    hub = ProgressHub()
    heard: list[PhaseEvent] = []
    always: list[PhaseEvent] = []

    def broken(_: PhaseEvent) -> None:
        raise RuntimeError("listener bug")

    hub.subscribe(broken)
    unsubscribe = hub.subscribe(always.append)
    with caplog.at_level(logging.ERROR, logger="agentic_lora.gateway.progress"):
        hub(event("e0"))
        with hub.listening(heard.append):
            assert len(hub) == 3
            hub(event("e1"))
        hub(event(None, Phase.COMMIT))
    assert heard == [event("e1")]
    assert always == [event("e0"), event("e1"), event(None, Phase.COMMIT)]
    assert len(hub) == 2
    assert [(r.getMessage(), getattr(r, "engine")) for r in caplog.records] == [  # noqa: B009
        ("progress listener failed", "e0"),
        ("progress listener failed", "e1"),
        ("progress listener failed", None),
    ]
    unsubscribe()
    unsubscribe()  # idempotent
    assert len(hub) == 1


def test_a_listener_may_unsubscribe_while_it_is_being_called() -> None:
    hub = ProgressHub()
    calls: list[str] = []
    unsubscribe: Callable[[], None] = lambda: None  # noqa: E731

    def once(e: PhaseEvent) -> None:
        calls.append(f"once {e.engine}")
        unsubscribe()

    unsubscribe = hub.subscribe(once)
    hub.subscribe(lambda e: calls.append(f"always {e.engine}"))
    hub(event("e0"))
    hub(event("e1"))
    assert calls == ["once e0", "always e0", "always e1"]


# --- wire ---------------------------------------------------------------------------------------


class Color(enum.Enum):
    RED = 1


class Opaque:
    def __repr__(self) -> str:
        return "<opaque>"


def test_jsonable_turns_any_detail_into_something_json_can_carry(tmp_path: Path) -> None:
    value = {
        "enum": Color.RED,
        "path": tmp_path / "x",
        "set": frozenset({3}),
        "tuple": (1, "a"),
        "nested": {1: [Opaque()]},
        "none": None,
    }
    converted = jsonable(value)
    assert converted == {
        "enum": 1,
        "path": str(tmp_path / "x"),
        "set": [3],
        "tuple": [1, "a"],
        "nested": {"1": ["<opaque>"]},
        "none": None,
    }
    assert json.loads(json.dumps(converted)) == converted
    # So an error whose details hold such values still answers with a JSON body.
    payload = error_payload(ConfigurationError("bad", path=tmp_path, thing=Opaque()))
    assert payload == {
        "error": {
            "code": "CONFIG_ERROR",
            "message": "bad",
            "details": {"path": str(tmp_path), "thing": "<opaque>"},
        }
    }


def test_http_status_and_retry_advice_per_error() -> None:
    assert http_status(ValueError("bug")) == 500
    assert should_retry(ValueError("bug")) is False
    assert error_payload(KeyError("k")) == {
        "error": {
            "code": "AGENTIC_LORA_ERROR",
            "message": "unexpected KeyError: 'k'",
            "details": {},
        }
    }
    # An engine's own 4xx passes through; a busy engine (429, 408) may take it next time.
    for status, retry in ((400, False), (404, False), (408, True), (429, True)):
        refused = RequestRefusedError("engine said no", status=status)
        assert (http_status(refused), should_retry(refused)) == (status, retry)
    # A refusal without an engine answer (unreachable) is a retryable 503.
    unreachable = RequestRefusedError("connect failed")
    assert (http_status(unreachable), should_retry(unreachable)) == (503, True)
    # A 5xx status detail never turns a refusal into a server error of the engine's choosing.
    assert http_status(RequestRefusedError("odd", status=502)) == 503
    maybe = RequestIndeterminateError("lost", status=200)
    assert (http_status(maybe), should_retry(maybe)) == (502, False)
    assert should_retry(NoPublishedVersionError("not yet")) is True
    assert http_status(VersionConflictError("conflict")) == 409
    assert http_status(AgenticLoRAError("base")) == 500


# --- the admin client against a broken peer -----------------------------------------------------


class Peer:
    """An HTTP peer scripted as a list of answers (a response, or an exception to raise)."""

    def __init__(self, *answers: httpx.Response | Exception) -> None:
        self.answers = list(answers)
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def client(self, token: str | None = ADMIN_TOKEN) -> AdminClient:
        return AdminClient("http://gw/", token=token, transport=httpx.MockTransport(self))


def ndjson(*items: dict[str, Any], blank_lines: bool = False) -> httpx.Response:
    sep = "\n\n" if blank_lines else "\n"
    body = sep.join(json.dumps(i) for i in items) + "\n"
    return httpx.Response(200, content=body.encode(), headers={"content-type": NDJSON})


class CutOffStream(httpx.AsyncByteStream):
    """A response body that delivers ``first`` and then loses the connection."""

    def __init__(self, first: bytes) -> None:
        self.first = first

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield self.first
        raise httpx.ReadError("connection reset by peer")


PROGRESS = {"engine": "e0", "phase": "prepare", "status": "DONE", "seconds": 0.1}


@pytest.mark.asyncio
async def test_a_streamed_publication_skips_blank_lines_and_returns_the_result() -> None:
    peer = Peer(ndjson({"event": PROGRESS}, {"result": {"outcome": "PUBLISHED"}}, blank_lines=True))
    events: list[Any] = []
    async with peer.client() as admin:
        result = await admin.publish("/srv/a", "A", on_event=events.append)
        # Without a listener the events are read and dropped.
        peer.answers.append(ndjson({"event": PROGRESS}, {"result": {"outcome": "SKIPPED"}}))
        assert (await admin.publish("/srv/b", "B"))["outcome"] == "SKIPPED"
    assert result == {"outcome": "PUBLISHED"}
    assert events == [PROGRESS]
    first = peer.requests[0]
    assert (first.method, first.url.path) == ("POST", "/admin/publish")
    assert first.headers["accept"] == NDJSON
    assert first.headers["authorization"] == f"Bearer {ADMIN_TOKEN}"
    assert json.loads(first.content) == {"adapter_dir": "/srv/a", "version_id": "A"}


@pytest.mark.asyncio
async def test_an_error_line_in_the_stream_comes_back_as_its_typed_error() -> None:
    error = {"code": "VERSION_CONFLICT", "message": "A has other content", "details": {"v": "A"}}
    peer = Peer(
        ndjson({"event": PROGRESS}, {"error": error}),
        ndjson({"surprise": 1}),
    )
    async with peer.client() as admin:
        with pytest.raises(VersionConflictError) as conflict:
            await admin.publish("/srv/a", "A")
        with pytest.raises(AgenticLoRAError) as odd:
            await admin.publish("/srv/a", "A")
    assert (conflict.value.message, conflict.value.details) == ("A has other content", {"v": "A"})
    assert type(odd.value) is AgenticLoRAError
    assert odd.value.message == (
        "the gateway at http://gw answered HTTP 200 without an error body "
        "(is this an agentic-lora gateway?)"
    )
    assert odd.value.details == {"server": "http://gw", "status": 200}
    assert len(peer.requests) == 2


@pytest.mark.asyncio
async def test_a_stream_that_ends_or_breaks_without_an_outcome_is_indeterminate() -> None:
    cut = httpx.Response(200, stream=CutOffStream(json.dumps({"event": PROGRESS}).encode() + b"\n"))
    not_objects = httpx.Response(200, content=b"[1, 2]\n")
    peer = Peer(ndjson({"event": PROGRESS}), cut, not_objects)
    events: list[Any] = []
    async with peer.client() as admin:
        with pytest.raises(RequestIndeterminateError) as ended:
            await admin.publish("/srv/a", "A", on_event=events.append)
        with pytest.raises(RequestIndeterminateError) as broken:
            await admin.publish("/srv/a", "B", on_event=events.append)
        with pytest.raises(RequestIndeterminateError) as not_object:
            await admin.publish("/srv/a", "C")
    assert ended.value.message == (
        "the gateway at http://gw ended the publication stream of 'A' without an outcome; "
        "the publication may have happened (check `agentic-lora status`)"
    )
    assert broken.value.message.startswith(
        "POST /admin/publish to http://gw: the connection failed after the call went out "
        "(ReadError: connection reset by peer)"
    )
    assert not_object.value.message == ("POST /admin/publish: a progress line is not a JSON object")
    assert events == [PROGRESS, PROGRESS]  # each stream's progress arrived before it failed
    assert len(peer.requests) == 3  # nothing was resent


@pytest.mark.asyncio
async def test_unreachable_and_lost_calls_are_refused_or_indeterminate() -> None:
    peer = Peer(
        httpx.ConnectError("connection refused"),
        httpx.ConnectError("connection refused"),
        httpx.ReadTimeout("timed out"),
        httpx.RemoteProtocolError("server disconnected"),
    )
    async with peer.client() as admin:
        with pytest.raises(RequestRefusedError) as status_refused:
            await admin.status()
        with pytest.raises(RequestRefusedError) as publish_refused:
            await admin.publish("/srv/a", "A")
        with pytest.raises(RequestIndeterminateError) as reclaim_lost:
            await admin.reclaim()
        with pytest.raises(RequestIndeterminateError) as publish_lost:
            await admin.publish("/srv/a", "A")
    for refused in (status_refused.value, publish_refused.value):
        assert refused.message == (
            "cannot reach the agentic-lora gateway at http://gw (ConnectError: connection "
            "refused); is `agentic-lora serve` running?"
        )
        assert refused.details == {"server": "http://gw"}
    assert reclaim_lost.value.message == (
        "POST /admin/reclaim to http://gw: the connection failed after the call went out "
        "(ReadTimeout: timed out); it may have taken effect (check `agentic-lora status`)"
    )
    assert "(RemoteProtocolError: server disconnected)" in publish_lost.value.message
    assert [r.url.path for r in peer.requests] == [
        "/admin/status",
        "/admin/publish",
        "/admin/reclaim",
        "/admin/publish",
    ]


@pytest.mark.asyncio
async def test_answers_that_are_not_the_gateways_are_typed_errors() -> None:
    peer = Peer(
        httpx.Response(502, text="<html>Bad Gateway</html>"),
        httpx.Response(200, text="<html>welcome</html>"),
        httpx.Response(200, json=["not", "an", "object"]),
        httpx.Response(
            401,
            json={"error": {"code": "ACCESS_DENIED", "message": "wrong token", "details": 3}},
        ),
        httpx.Response(503, json={"error": {"code": "NO_SUCH_CODE", "message": "new"}}),
        httpx.Response(
            400,
            json={"error": {"code": "INVALID_REQUEST", "message": "relative", "details": {}}},
        ),
    )
    async with peer.client(token=None) as admin:
        with pytest.raises(AgenticLoRAError) as html_error:
            await admin.status()
        with pytest.raises(RequestIndeterminateError) as html_ok:
            await admin.reclaim()
        with pytest.raises(RequestIndeterminateError) as listed:
            await admin.status()
        with pytest.raises(AgenticLoRAError) as denied:
            await admin.status()
        with pytest.raises(AgenticLoRAError) as unknown:
            await admin.status()
        with pytest.raises(AgenticLoRAError) as refused_stream:
            await admin.publish("rel", "A")
    assert type(html_error.value) is AgenticLoRAError
    assert html_error.value.details == {"server": "http://gw", "status": 502}
    assert "answered HTTP 502 without an error body" in html_error.value.message
    assert html_ok.value.message == "POST /admin/reclaim: the gateway's answer is not JSON"
    assert listed.value.message == "GET /admin/status answered something that is not a JSON object"
    assert (denied.value.code, denied.value.message, denied.value.details) == (
        "ACCESS_DENIED",
        "wrong token",
        {},
    )
    assert (type(unknown.value), unknown.value.message) == (AgenticLoRAError, "new")
    assert refused_stream.value.code == "INVALID_REQUEST"
    assert all("authorization" not in r.headers for r in peer.requests)


def test_a_gateway_url_must_be_http() -> None:
    for url in ("ftp://gw", "gw:8000", ""):
        with pytest.raises(RequestRefusedError) as err:
            AdminClient(url, token="t")
        assert err.value.message == f"the gateway URL {url!r} is not http(s)"
        assert err.value.details == {"server": url}
