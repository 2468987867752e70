"""Control calls to an engine (``server_info``): odd answers, the legacy path, lost replies.

Unlike a generation, a control call is idempotent: it is asked again (up to a bound) after a
lost reply or a 5xx.
"""

from __future__ import annotations

import httpx
import pytest
import respx

from agentic_lora.errors import ConfigurationError
from agentic_lora.errors import RequestIndeterminateError
from agentic_lora.errors import RequestRefusedError
from tests.engines.test_transport import URL
from tests.engines.test_transport import transport


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
