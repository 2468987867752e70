"""The engine transport's replies: cut off mid-body, bodies that are not JSON or not SGLang-shaped.

A reply whose head arrived but whose body did not is still classified by its status (a 4xx
proves refusal, anything else may have run), and nothing is ever resent. Loopback servers and
the transport come from ``test_transport.py``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable
from collections.abc import Callable

import httpx
import pytest
import respx

from agentic_lora.engines.transport import EngineReply
from agentic_lora.errors import RequestIndeterminateError
from agentic_lora.errors import RequestRefusedError
from tests.engines.loopback import loopback_server
from tests.engines.loopback import read_request
from tests.engines.test_transport import KINDS
from tests.engines.test_transport import URL
from tests.engines.test_transport import send_once
from tests.engines.test_transport import transport

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
@pytest.mark.parametrize(
    ("status", "error", "outcome", "said"),
    [
        # The engine answered, so it has the request: it may have run it.
        (
            200,
            RequestIndeterminateError,
            "indeterminate",
            "POST /generate to e0: reply lost while reading it .*the engine may have run",
        ),
        # A 4xx still proves refusal, whatever became of its body.
        (400, RequestRefusedError, "refused", "POST /generate to e0 refused with HTTP 400"),
    ],
)
async def test_a_reply_cut_off_mid_body_is_classified_by_its_status_and_sent_once(
    kind: str,
    status: int,
    error: type[RequestIndeterminateError | RequestRefusedError],
    outcome: str,
    said: str,
) -> None:
    requests: list[bytes] = []
    async with loopback_server(truncated_reply(status, requests)) as url:
        with pytest.raises(error, match=said) as err:
            await send_once(kind, url, {"text": "x", "rid": "r-cut"})
    assert err.value.details["status"] == status
    assert err.value.details["outcome"] == outcome
    assert (err.value.details["engine"], err.value.details["rid"]) == ("e0", "r-cut")
    assert [json.loads(r) for r in requests] == [{"text": "x", "rid": "r-cut"}]


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
