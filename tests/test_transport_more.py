"""The engine transport, continued: replies cut off mid-body, odd bodies, the transport fallback.

Complements ``test_transport.py`` (whose loopback helpers it reuses): a reply whose head arrived
but whose body did not is still classified by its status (a 4xx proves refusal, anything else
may have run), and nothing is ever resent.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
import respx

from agentic_lora.engines.backends import EngineRef
from agentic_lora.engines.transport import EngineReply, EngineTransport
from agentic_lora.errors import (
    ConfigurationError,
    RequestIndeterminateError,
    RequestRefusedError,
)
from tests.test_transport import KINDS, URL, loopback_server, read_request, send_once, transport

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def truncated_reply(status: int, requests: list[bytes]) -> Handler:
    """A handler that reads the request, promises a 100-byte body, sends 10 bytes and hangs up."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        requests.append(await read_request(reader))
        reason = "OK" if status == 200 else "Bad Request"
        writer.write(
            f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n".encode()
            + b"content-length: 100\r\n\r\n"
            + b'{"text": "'
        )
        await writer.drain()
        writer.close()
        await writer.wait_closed()

    return handle


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", KINDS)
async def test_a_2xx_reply_cut_off_mid_body_is_indeterminate_and_sent_once(kind: str) -> None:
    requests: list[bytes] = []
    async with loopback_server(truncated_reply(200, requests)) as url:
        with pytest.raises(RequestIndeterminateError) as err:
            await send_once(kind, url, {"text": "x", "rid": "r-cut"})
    assert "reply lost while reading it" in err.value.message
    assert "the engine may have run the request" in err.value.message
    assert err.value.details["status"] == 200
    assert err.value.details["outcome"] == "indeterminate"
    assert (err.value.details["engine"], err.value.details["rid"]) == ("e0", "r-cut")
    assert [json.loads(r) for r in requests] == [{"text": "x", "rid": "r-cut"}]


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", KINDS)
async def test_a_4xx_reply_cut_off_mid_body_is_still_a_refusal(kind: str) -> None:
    requests: list[bytes] = []
    async with loopback_server(truncated_reply(400, requests)) as url:
        with pytest.raises(RequestRefusedError) as err:
            await send_once(kind, url, {"text": "x"})
    assert err.value.message.startswith("POST /generate to e0 refused with HTTP 400")
    assert err.value.details["status"] == 400
    assert err.value.details["outcome"] == "refused"
    assert len(requests) == 1


@pytest.mark.asyncio
async def test_bodies_that_are_not_json_or_not_sglang_shaped_are_kept_as_they_are() -> None:
    async with transport() as t:
        with respx.mock(using="httpx") as mock:
            mock.post(URL + "/generate").mock(
                side_effect=[
                    httpx.Response(200, text="plain words"),
                    httpx.Response(200, json={"text": "x", "meta_info": {"id": "r"}}),
                    httpx.Response(200, json={"meta_info": {"finish_reason": "stop"}}),
                    httpx.Response(200, json={"meta_info": {"finish_reason": {"type": "abort"}}}),
                ]
            )
            text = await t.send("e0", "/generate", {"text": "x"})
            no_reason = await t.send("e0", "/generate", {"text": "x"})
            odd_reason = await t.send("e0", "/generate", {"text": "x"})
            aborted = await t.send("e0", "/generate", {"text": "x", "rid": "r-abort"})
    assert (text.body, text.finish_reason, text.aborted) == ("plain words", None, False)
    assert (no_reason.finish_reason, no_reason.aborted) == (None, False)
    assert (odd_reason.finish_reason, odd_reason.aborted) == (None, False)
    assert aborted.finish_reason == {"type": "abort"}
    assert aborted.aborted is True
    assert aborted.rid == "r-abort"


def test_a_reply_without_meta_info_has_no_finish_reason() -> None:
    for body in (None, [1, 2], {"meta_info": [1]}, {"text": "x"}):
        reply = EngineReply(engine="e0", path="/generate", status_code=200, body=body)
        assert reply.finish_reason is None
        assert reply.aborted is False


@pytest.mark.asyncio
async def test_server_info_that_is_not_an_object_is_indeterminate() -> None:
    async with transport() as t:
        with respx.mock(using="httpx") as mock:
            route = mock.get(URL + "/server_info").respond(200, json=["not", "an", "object"])
            with pytest.raises(RequestIndeterminateError) as err:
                await t.server_info("e0")
            # A well-formed 200 is an answer, not a lost reply: asked once.
            assert route.call_count == 1
    assert err.value.message == (
        "server_info of e0: /server_info is not a JSON object [indeterminate]"
    )
    assert err.value.details["engine"] == "e0"
    assert err.value.details["outcome"] == "indeterminate"


@pytest.mark.asyncio
async def test_server_info_falls_back_to_the_legacy_path_and_retries_a_5xx() -> None:
    async with transport(attempts=2) as t:
        with respx.mock(using="httpx") as mock:
            new = mock.get(URL + "/server_info").respond(404, json={"detail": "Not Found"})
            old = mock.get(URL + "/get_server_info")
            old.side_effect = [httpx.Response(503), httpx.Response(200, json={"enable_lora": 1})]
            assert await t.server_info("e0") == {"enable_lora": 1}
            assert (new.call_count, old.call_count) == (1, 2)
            # A 4xx other than 404 is the engine's answer: refused, never asked again.
            new.respond(403, json={"detail": "no"})
            with pytest.raises(RequestRefusedError) as refused:
                await t.server_info("e0")
            assert refused.value.details["status"] == 403
            assert new.call_count == 2
            # A 5xx on every attempt: indeterminate, after the bound.
            new.respond(500)
            with pytest.raises(RequestIndeterminateError) as failed:
                await t.server_info("e0")
            assert failed.value.details["status"] == 500
            assert new.call_count == 4


@pytest.mark.asyncio
async def test_server_info_lost_replies_are_asked_again_up_to_the_bound() -> None:
    async with transport(attempts=2) as t:
        with respx.mock(using="httpx") as mock:
            route = mock.get(URL + "/server_info")
            route.side_effect = [httpx.ReadError("lost"), httpx.Response(200, json={"ok": 1})]
            assert await t.server_info("e0") == {"ok": 1}
            assert route.call_count == 2
            route.side_effect = [httpx.ReadError("lost")] * 2
            with pytest.raises(RequestIndeterminateError, match="may have been accepted"):
                await t.server_info("e0")
            assert route.call_count == 4


def test_control_attempts_below_one_are_refused() -> None:
    with pytest.raises(ConfigurationError) as err:
        transport(attempts=0)
    assert err.value.details["check"] == "control_attempts"
    assert err.value.code == "CONFIG_ERROR"


@pytest.mark.asyncio
async def test_as_a_context_manager_it_closes_and_then_refuses_every_send() -> None:
    with respx.mock(using="httpx") as mock:
        route = mock.post(URL + "/generate").respond(200, json={"text": "ok"})
        async with transport() as t:
            assert (await t.send("e0", "/generate", {"text": "x"})).body == {"text": "ok"}
        with pytest.raises(RequestRefusedError, match="the engine transport is closed"):
            await t.send("e0", "/generate", {"text": "x"})
        await t.aclose()  # idempotent
        assert route.call_count == 1


@pytest.mark.asyncio
async def test_without_httpx_aiohttp_it_falls_back_to_the_httpx_transport(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A None entry in sys.modules makes the import fail as if the package were not installed.
    monkeypatch.setitem(sys.modules, "httpx_aiohttp", None)
    with caplog.at_level(logging.WARNING, logger="agentic_lora.engines.transport"):
        t = EngineTransport([EngineRef("e0", URL)], http_transport="aiohttp")
    try:
        assert t.http_transport == "httpx"
        assert [r.getMessage() for r in caplog.records] == [
            "httpx-aiohttp is not installed; using httpx's default transport"
        ]
        with respx.mock(using="httpx") as mock:
            route = mock.post(URL + "/generate").respond(200, json={"text": "ok"})
            reply = await t.send("e0", "/generate", {"text": "x"})
        assert reply.body == {"text": "ok"}
        assert route.call_count == 1
    finally:
        await t.aclose()


@pytest.mark.asyncio
async def test_idle_connections_expire_before_the_engines_keep_alive_closes_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Equal client and server keep-alive (5 s) loses generations to connections the server is
    # closing (bench/keepalive_race.py); the transport must expire idle connections earlier.
    import agentic_lora.engines.transport as transport_module
    from agentic_lora.engines.backends import EngineRef
    from agentic_lora.engines.transport import EngineTransport
    from agentic_lora.errors import ConfigurationError
    from agentic_lora.foundation.http_limits import engine_limits

    seen: list[httpx.Limits] = []
    real = transport_module.make_engine_client

    def spy(kind: Any, timeout: httpx.Timeout, limits: httpx.Limits) -> Any:
        seen.append(limits)
        return real(kind, timeout, limits)

    monkeypatch.setattr(transport_module, "make_engine_client", spy)
    engines = [EngineRef("e0", "http://127.0.0.1:1")]
    for given, expected in ((None, 2.0), (1.5, 1.5)):
        made = (
            EngineTransport(engines)
            if given is None
            else EngineTransport(engines, keepalive_expiry=given)
        )
        await made.aclose()
        assert seen[-1].keepalive_expiry == expected
    for bad in (0.0, 5.0, 30.0):
        with pytest.raises(ConfigurationError) as err:
            EngineTransport(engines, keepalive_expiry=bad)
        assert err.value.details["check"] == "keepalive"
    assert engine_limits().keepalive_expiry == 2.0  # the admin and sidecar clients' pools too
