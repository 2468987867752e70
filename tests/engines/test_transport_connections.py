"""The engine transport's connections: closing it, the httpx fallback, idle connections."""

from __future__ import annotations

import logging
import sys
from typing import Any

import httpx
import pytest
import respx

from agentic_lora.engines.backends import EngineRef
from agentic_lora.engines.transport import EngineTransport
from agentic_lora.errors import ConfigurationError
from agentic_lora.errors import RequestRefusedError
from tests.engines.test_transport import URL
from tests.engines.test_transport import transport


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
async def test_without_aiohttp_it_falls_back_to_the_httpx_stack(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A None entry in sys.modules makes the import fail as if the package were not installed.
    monkeypatch.setitem(sys.modules, "aiohttp", None)
    monkeypatch.delitem(sys.modules, "agentic_lora.engines.aiohttp_stack", raising=False)
    with caplog.at_level(logging.WARNING, logger="agentic_lora.engines.stacks"):
        t = EngineTransport([EngineRef("e0", URL)], http_transport="aiohttp")
    try:
        assert t.http_transport == "httpx"
        assert [r.getMessage() for r in caplog.records] == [
            "aiohttp is not installed; the engine transport uses httpx"
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
    from agentic_lora.foundation.http_limits import engine_limits

    seen: list[httpx.Limits] = []
    real = transport_module.make_stack

    def spy(kind: Any, timeout: httpx.Timeout, limits: httpx.Limits) -> Any:
        seen.append(limits)
        return real(kind, timeout, limits)

    monkeypatch.setattr(transport_module, "make_stack", spy)
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
