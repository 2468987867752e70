"""The aiohttp stack under the engine transport, against a scripted engine on a loopback socket.

respx scripts the httpx stack (tests/engines/test_transport.py runs the transport's rules there);
these tests hold the default stack, aiohttp used directly, to the same rules: one attempt for every
failure class, the same request on the wire, and streamed lines as the engine wrote them.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest
from tenacity import wait_none

from agentic_lora.engines.backends import EngineRef
from agentic_lora.engines.transport import EngineTransport
from agentic_lora.engines.transport import Outcome
from agentic_lora.errors import RequestIndeterminateError
from agentic_lora.errors import RequestRefusedError
from tests.engines.loopback import Action
from tests.engines.loopback import Answer
from tests.engines.loopback import Drop
from tests.engines.loopback import Hang
from tests.engines.loopback import LoopbackEngine

#: The read timeout of the one case whose verdict is a timeout: the engine holds that request
#: forever, so the verdict is the same however fast the machine is. Every other case keeps the
#: transport's default, so a stalled machine cannot turn its answer into a timeout.
SHORT_TIMEOUT = 0.5
#: The pool wait of the pool-timeout case. The same aiohttp timer also bounds the held request's
#: own connect, which must succeed: wide enough that a stalled loop never fails it.
POOL_WAIT = 2.0


def stack(url: str, **options: Any) -> EngineTransport:
    return EngineTransport(
        [EngineRef("e0", url)],
        http_transport="aiohttp",
        control_wait=wait_none(),
        **options,
    )


def test_the_default_stack_is_aiohttp() -> None:
    t = EngineTransport([EngineRef("e0", "http://127.0.0.1:9")])
    assert t.http_transport == "aiohttp"


#: One generation failure of every class the aiohttp stack can meet (rule 4.2-2), the error the
#: caller gets, and its outcome. aiohttp has no write timeout (httpx's is in test_transport).
FAILURES: dict[str, tuple[Action, type[Exception], Outcome]] = {
    "refused: 4xx answer": (
        Answer.json(400, {"error": {"message": "bad adapter"}}),
        RequestRefusedError,
        Outcome.REFUSED,
    ),
    "indeterminate: 5xx answer": (
        Answer.json(503, {}),
        RequestIndeterminateError,
        Outcome.INDETERMINATE,
    ),
    "disconnect after the request arrived": (
        Drop(),
        RequestIndeterminateError,
        Outcome.INDETERMINATE,
    ),
    "timeout: reading the reply": (Hang(), RequestIndeterminateError, Outcome.INDETERMINATE),
}


@pytest.mark.asyncio
@pytest.mark.parametrize("failure", sorted(FAILURES))
async def test_a_failed_generation_is_attempted_exactly_once_whatever_the_failure(
    failure: str,
) -> None:
    action, expected, outcome = FAILURES[failure]
    timeout = SHORT_TIMEOUT if isinstance(action, Hang) else 600.0
    # A second attempt, if there were one, would succeed: only a retry could hide the failure.
    async with LoopbackEngine([action, Answer.json(200, {"text": "ok"})]) as engine:
        async with stack(engine.url, request_timeout=timeout) as t:
            with pytest.raises(expected) as raised:
                await t.send("e0", "/generate", {"text": "x", "rid": "r1"})
            assert raised.value.details["outcome"] == outcome.value
        await engine.wait_for_requests(1)  # a timed-out request may be read after the timeout
        assert [s.json() for s in engine.seen] == [{"text": "x", "rid": "r1"}]


@pytest.mark.asyncio
async def test_no_pooled_connection_in_time_is_refused_and_never_sent() -> None:
    async with LoopbackEngine([Hang()]) as engine:
        async with stack(engine.url, max_connections=1, connect_timeout=POOL_WAIT) as t:
            holder = asyncio.ensure_future(t.send("e0", "/generate", {"text": "hold", "rid": "r0"}))
            await engine.wait_for_requests(1)  # the one connection is taken, and held
            with pytest.raises(RequestRefusedError, match="was not sent"):
                await t.send("e0", "/generate", {"text": "x", "rid": "r1"})
            holder.cancel()
        assert [s.json()["rid"] for s in engine.seen] == ["r0"]


@pytest.mark.asyncio
async def test_connection_refused_is_refused() -> None:
    with socket.socket() as sock:  # bound, not listening: the kernel refuses, deterministically
        sock.bind(("127.0.0.1", 0))
        async with stack(f"http://127.0.0.1:{sock.getsockname()[1]}") as t:
            with pytest.raises(RequestRefusedError, match="was not sent"):
                await t.send("e0", "/generate", {"text": "x"})


@pytest.mark.asyncio
async def test_the_request_on_the_wire_and_keep_alive() -> None:
    async with LoopbackEngine(
        [Answer.json(200, {"text": "ok"}), Answer.json(200, {"version": "x"})]
    ) as engine:
        # The longest keep-alive the transport allows: the pooled connection outlives any stall
        # of a loaded machine between the two requests.
        async with stack(engine.url, keepalive_expiry=4.9) as t:
            body = {"text": "héllo", "rid": "r1", "sampling_params": {"max_new_tokens": 2}}
            reply = await t.send("e0", "/generate", body)
            assert (reply.status_code, reply.body, reply.rid) == (200, {"text": "ok"}, "r1")
            info = await t.server_info("e0")
        post, get = engine.seen
        assert (post.method, post.path) == ("POST", "/generate")
        assert post.headers["content-type"] == "application/json"
        # Compact JSON, UTF-8 as written: the bytes the httpx stack sends (test_transport).
        assert (
            post.body
            == '{"text":"héllo","rid":"r1","sampling_params":{"max_new_tokens":2}}'.encode()
        )
        assert (get.method, get.body, "content-type" in get.headers) == ("GET", b"", False)
        assert info == {"version": "x"}
        assert engine.connections == 1  # the second request reused the first one's connection


@pytest.mark.asyncio
async def test_a_body_that_is_not_json_comes_back_as_text() -> None:
    async with (
        LoopbackEngine(
            [Answer(200, (b"plain ", "tëxt".encode("latin-1")), "text/plain; charset=latin-1")]
        ) as engine,
        stack(engine.url) as t,
    ):
        reply = await t.send("e0", "/generate", {"text": "x"})
    assert reply.body == "plain tëxt"


@pytest.mark.asyncio
async def test_streamed_payloads_are_the_engine_s_events_however_its_lines_are_cut() -> None:
    long = "x" * 200_000  # longer than aiohttp's line buffer
    chunks = (
        b'data: {"a": 1}\r\n',
        b'\r\ndata: {"b"',
        b": 2}\n\ndata: " + long.encode() + b"\n",
        b"\n: a comment\n\ndata: [DONE]",
    )
    script = [Answer(200, chunks, "text/event-stream")]
    request = {"text": "x", "stream": True}
    async with (
        LoopbackEngine(script) as engine,
        stack(engine.url) as t,
        t.open_stream("e0", "/generate", request) as payloads,
    ):
        got = [payload async for payload in payloads]
    # Lines split across reads and longer than aiohttp's buffer come whole; blank lines and
    # comments carry nothing and are skipped.
    assert got == ['{"a": 1}', '{"b": 2}', long, "[DONE]"]
    assert engine.seen[0].json() == {"text": "x", "stream": True}


@pytest.mark.asyncio
async def test_a_stream_refused_before_its_first_chunk_carries_the_engine_s_answer() -> None:
    async with (
        LoopbackEngine([Answer.json(400, {"error": {"message": "no such adapter"}})]) as engine,
        stack(engine.url) as t,
    ):
        with pytest.raises(RequestRefusedError) as refused:
            async with t.open_stream("e0", "/generate", {"text": "x", "stream": True}):
                pass
    assert refused.value.details["status"] == 400
    assert refused.value.details["body"] == {"error": {"message": "no such adapter"}}
    assert len(engine.seen) == 1


@pytest.mark.asyncio
async def test_a_stream_left_before_its_end_closes_its_connection() -> None:
    # The engine writes one chunk and then holds the rest: the client leaves after one line, and
    # the next request needs a new connection (the half-read one was cut, not pooled).
    async with LoopbackEngine(
        [Answer(200, (b"data: 1\n\n",), "text/event-stream", hold=True)]
    ) as engine:
        async with stack(engine.url) as t:
            async with t.open_stream("e0", "/generate", {"text": "x", "stream": True}) as events:
                assert await anext(aiter(events)) == "1"
            await t.send("e0", "/generate", {"text": "y"})
        assert [s.json()["text"] for s in engine.seen] == ["x", "y"]
        assert engine.connections == 2
