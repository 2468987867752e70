"""The engine transport: one attempt, every failure classified refused or indeterminate.

The classification is checked twice: with respx (scripted engine answers, on the httpx stack) and
against real loopback sockets on both stacks, because respx replaces httpx's transport and so can
neither script the aiohttp stack nor show how a connection dies after the request was written
(the aiohttp stack's own scripted cases: tests/engines/test_aiohttp_stack.py).
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import respx
from tenacity import wait_none

from agentic_lora.engines.backends import EngineRef
from agentic_lora.engines.transport import GENERATION_STOP
from agentic_lora.engines.transport import EngineReply
from agentic_lora.engines.transport import EngineTransport
from agentic_lora.engines.transport import Outcome
from agentic_lora.engines.transport import classify_exception
from agentic_lora.engines.transport import classify_status
from agentic_lora.errors import ConfigurationError
from agentic_lora.errors import RequestIndeterminateError
from agentic_lora.errors import RequestRefusedError
from agentic_lora.errors import UnknownEngineError
from tests.engines.loopback import loopback_server
from tests.engines.loopback import read_request

URL = "http://127.0.0.1:30000"
KINDS = ["aiohttp", "httpx"]


def transport(kind: str = "httpx", url: str = URL, attempts: int = 3) -> EngineTransport:
    return EngineTransport(
        [EngineRef("e0", url)],
        http_transport=kind,  # type: ignore[arg-type]
        control_attempts=attempts,
        control_wait=wait_none(),
        request_timeout=30,
        connect_timeout=5,
    )


async def send_once(kind: str, url: str, body: dict[str, Any]) -> EngineReply:
    """One ``POST /generate`` to e0 at ``url`` through a fresh transport, closed after it."""
    async with transport(kind, url) as t:
        return await t.send("e0", "/generate", body)


def test_status_classes() -> None:
    assert classify_status(200) is None
    assert classify_status(204) is None
    for code in (400, 404, 408, 422, 429):
        assert classify_status(code) is Outcome.REFUSED
    for code in (301, 500, 502, 503, 504):
        assert classify_status(code) is Outcome.INDETERMINATE


def test_exception_classes_without_a_cause() -> None:
    req = httpx.Request("POST", URL)
    for refused in (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout):
        assert classify_exception(refused("x", request=req)) is Outcome.REFUSED
    for maybe in (
        httpx.ReadTimeout,
        httpx.WriteTimeout,
        httpx.ReadError,
        httpx.RemoteProtocolError,
    ):
        assert classify_exception(maybe("x", request=req)) is Outcome.INDETERMINATE


def test_an_aiohttp_cause_decides_over_the_httpx_type() -> None:
    import aiohttp

    # httpx-aiohttp reports a server disconnect as ConnectTimeout: the cause must win.
    after_send = httpx.ConnectTimeout("x")
    after_send.__cause__ = aiohttp.ServerDisconnectedError()
    assert classify_exception(after_send) is Outcome.INDETERMINATE
    before_send = httpx.ConnectTimeout("x")
    before_send.__cause__ = aiohttp.ConnectionTimeoutError()
    assert classify_exception(before_send) is Outcome.REFUSED


def test_the_generation_policy_is_one_attempt() -> None:
    assert GENERATION_STOP.max_attempt_number == 1  # type: ignore[attr-defined]
    assert transport().generation_stop is GENERATION_STOP


def _disconnected() -> BaseException:
    import aiohttp

    return aiohttp.ServerDisconnectedError()


#: One generation failure of every class (rule 4.2-2), scripted at the outer edge, and what the
#: caller must be told about it.
FAILURES: dict[str, tuple[Callable[[], object], type[Exception]]] = {
    "refused: connection refused": (lambda: httpx.ConnectError("refused"), RequestRefusedError),
    "refused: 4xx answer": (
        lambda: httpx.Response(400, json={"error": {"message": "bad adapter"}}),
        RequestRefusedError,
    ),
    "indeterminate: 5xx answer": (lambda: httpx.Response(503), RequestIndeterminateError),
    "timeout: reading the reply": (lambda: httpx.ReadTimeout("slow"), RequestIndeterminateError),
    "timeout: writing the body": (lambda: httpx.WriteTimeout("slow"), RequestIndeterminateError),
    "timeout: no pooled connection": (lambda: httpx.PoolTimeout("busy"), RequestRefusedError),
    "disconnect: httpx": (
        lambda: httpx.RemoteProtocolError("Server disconnected"),
        RequestIndeterminateError,
    ),
    "disconnect: aiohttp": (_disconnected, RequestIndeterminateError),
}


@pytest.mark.asyncio
@pytest.mark.parametrize("failure", sorted(FAILURES))
async def test_a_failed_generation_is_attempted_exactly_once_whatever_the_failure(
    failure: str,
) -> None:
    # The control calls of the same transport do retry (3 attempts): the generation must not.
    make, expected = FAILURES[failure]
    async with transport(attempts=3) as t:
        with respx.mock(using="httpx") as mock:
            route = mock.post(URL + "/generate")
            # A second attempt, if there were one, would succeed: only a retry could hide the
            # failure from the caller.
            route.side_effect = [make(), httpx.Response(200, json={"text": "ok"})]
            with pytest.raises(expected):
                await t.send("e0", "/generate", {"text": "x", "rid": "r1"})
            assert route.call_count == 1


@pytest.mark.asyncio
async def test_scripted_answers_are_classified_and_sent_once() -> None:
    async with transport() as t:
        with respx.mock(using="httpx") as mock:
            route = mock.post(URL + "/generate")
            route.side_effect = [
                httpx.Response(
                    200, json={"text": "ok", "meta_info": {"finish_reason": {"type": "stop"}}}
                ),
                httpx.Response(400, json={"error": {"message": "too long"}}),
                httpx.Response(503, json={"error": {"message": "busy"}}),
                httpx.ConnectError("refused"),
                httpx.ReadTimeout("lost"),
            ]
            ok = await t.send("e0", "/generate", {"text": "x", "rid": "r0"})
            assert (ok.status_code, ok.rid, ok.aborted) == (200, "r0", False)
            with pytest.raises(RequestRefusedError) as refused:
                await t.send("e0", "/generate", {"text": "x"})
            assert refused.value.details["status"] == 400
            with pytest.raises(RequestIndeterminateError) as busy:
                await t.send("e0", "/generate", {"text": "x"})
            assert busy.value.details["status"] == 503
            with pytest.raises(RequestRefusedError, match="was not sent"):
                await t.send("e0", "/generate", {"text": "x"})
            with pytest.raises(RequestIndeterminateError, match="indeterminate"):
                await t.send("e0", "/generate", {"text": "x"})
            assert route.call_count == 5  # five sends, five requests: nothing retried
    assert t.http_transport == "httpx"


@pytest.mark.asyncio
async def test_body_goes_out_as_compact_json_with_the_json_content_type() -> None:
    async with transport() as t:
        with respx.mock(using="httpx") as mock:
            route = mock.post(URL + "/v1/completions").respond(200, json={"choices": []})
            body = {"model": "m:a", "prompt": "héllo", "max_tokens": 3}
            await t.send("e0", "/v1/completions", body)
            sent = route.calls.last.request
            assert sent.headers["content-type"] == "application/json"
            assert (
                sent.content == json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
            )
            # The request is built without the client's build_request, yet is the one it builds.
            timeout = httpx.Timeout(30, connect=5, pool=5)
            async with httpx.AsyncClient(trust_env=False, timeout=timeout) as plain:
                expected = plain.build_request(
                    "POST",
                    URL + "/v1/completions",
                    content=sent.content,
                    headers={"content-type": "application/json"},
                )
            assert sent.headers.raw == expected.headers.raw
            assert sent.extensions["timeout"] == expected.extensions["timeout"]
            info = mock.get(URL + "/server_info").respond(200, json={"x": 1})
            await t.server_info("e0")
            got = info.calls.last.request
            assert "content-type" not in got.headers
            assert got.headers["user-agent"] == expected.headers["user-agent"]


@pytest.mark.asyncio
async def test_a_streamed_request_goes_out_as_the_one_shot_request_does() -> None:
    t = transport()
    try:
        with respx.mock(using="httpx") as mock:
            route = mock.post(URL + "/generate").respond(200, json={})
            body = {"text": "héllo", "rid": "r1"}
            await t.send("e0", "/generate", body)
            one_shot = route.calls.last.request
            route.respond(200, text="data: [DONE]\n\n")
            async with t.open_stream("e0", "/generate", {**body, "stream": True}) as payloads:
                assert [payload async for payload in payloads] == ["[DONE]"]
            streamed = route.calls.last.request

            def headers(request: httpx.Request) -> list[tuple[bytes, bytes]]:
                return [(k, v) for k, v in request.headers.raw if k.lower() != b"content-length"]

            # Built by the same fast path: the client's own headers, the JSON content type.
            assert headers(streamed) == headers(one_shot)
            assert json.loads(streamed.content) == {**body, "stream": True}
            assert streamed.extensions["timeout"] == one_shot.extensions["timeout"]
            assert route.call_count == 2
    finally:
        await t.aclose()


@pytest.mark.asyncio
async def test_abort_is_retried_on_transport_failures_but_not_on_a_4xx() -> None:
    async with transport(attempts=3) as t:
        with respx.mock(using="httpx") as mock:
            route = mock.post(URL + "/abort_request")
            route.side_effect = [httpx.Response(503), httpx.ConnectError("x"), httpx.Response(200)]
            await t.abort("e0", "r1")
            assert route.call_count == 3
            assert all(json.loads(c.request.content) == {"rid": "r1"} for c in route.calls)

            route.side_effect = [httpx.Response(400)]
            with pytest.raises(RequestRefusedError):
                await t.abort("e0", "r2")
            assert route.call_count == 4

            route.side_effect = [httpx.Response(500)] * 3
            with pytest.raises(RequestIndeterminateError):
                await t.abort("e0", "r3")
            assert route.call_count == 7


@pytest.mark.asyncio
async def test_server_info_and_unknown_engine_and_closed_transport() -> None:
    t = transport()
    with respx.mock(using="httpx") as mock:
        mock.get(URL + "/server_info").respond(200, json={"enable_lora": True})
        info = await t.server_info("e0")
        assert info is not None
        assert info["enable_lora"] is True
        with pytest.raises(UnknownEngineError):
            await t.send("e9", "/generate", {"text": "x"})
        await t.aclose()
        with pytest.raises(RequestRefusedError, match="closed"):
            await t.send("e0", "/generate", {"text": "x"})
        assert mock.calls.call_count == 1  # only server_info reached the engine


def test_fleet_shape_is_checked() -> None:
    with pytest.raises(ConfigurationError) as empty:
        EngineTransport([])
    assert empty.value.details["check"] == "empty_fleet"
    with pytest.raises(ConfigurationError) as dup:
        EngineTransport([EngineRef("e0", URL), EngineRef("e0", "http://127.0.0.1:30001")])
    assert dup.value.details["check"] == "duplicate_engine"


# --- real loopback sockets ------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", KINDS)
async def test_connection_refused_is_refused(kind: str) -> None:
    # A bound socket that is not listening: the kernel refuses connections, deterministically.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        with pytest.raises(RequestRefusedError):
            await send_once(kind, url, {"text": "x"})


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", KINDS)
async def test_connection_closed_after_the_request_arrived_is_indeterminate(kind: str) -> None:
    received: list[bytes] = []

    async def accept_then_drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        received.append(await read_request(reader))  # the engine has the whole request...
        writer.close()  # ...and the reply never comes
        await writer.wait_closed()

    async with loopback_server(accept_then_drop) as url:
        with pytest.raises(RequestIndeterminateError):
            await send_once(kind, url, {"text": "x", "rid": "r-drop"})
    assert [json.loads(r) for r in received] == [{"text": "x", "rid": "r-drop"}]


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", KINDS)
async def test_a_real_answer_round_trips(kind: str) -> None:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        body = json.loads(await read_request(reader))
        payload = json.dumps({"text": "ok", "meta_info": {"id": body["rid"]}}).encode()
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            + f"content-length: {len(payload)}\r\nconnection: close\r\n\r\n".encode()
            + payload
        )
        await writer.drain()
        writer.close()
        await writer.wait_closed()

    async with loopback_server(answer) as url:
        reply = await send_once(kind, url, {"text": "x", "rid": "r-ok"})
    assert reply.body == {"text": "ok", "meta_info": {"id": "r-ok"}}
