"""Session.stream: every chunk names the bound version, the stream holds its version until it
ends, failures are classified before and after the first chunk, and a reader that leaves ends
the engine request (abort by id on SGLang, a closed connection on vLLM).

Against scripted engines (respx), the real LocalRegistry, Versioning, middleware and transport.
Concurrency is driven by held streams (asyncio.Event), never by timing.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx
import pytest

from agentic_lora.errors import InvalidRequestError
from agentic_lora.errors import RequestIndeterminateError
from agentic_lora.errors import RequestRefusedError
from agentic_lora.foundation.requests import Route
from agentic_lora.session.middleware import EngineCall
from agentic_lora.session.middleware import InFlight
from agentic_lora.session.streaming import StreamChunk
from agentic_lora.session.streaming import StreamEndpoint
from agentic_lora.session.streaming import UpstreamStream
from agentic_lora.testing.sglang_engine import EngineOp
from agentic_lora.testing.sglang_engine import Fault
from agentic_lora.testing.sglang_engine import FaultKind
from agentic_lora.testing.sglang_engine import ScriptedSGLangEngine
from agentic_lora.testing.streams import ScriptedStream
from agentic_lora.testing.streams import StreamEnding
from agentic_lora.testing.streams import generate_chunks
from agentic_lora.testing.vllm_engine import ScriptedVllmEngine
from tests.streaming_support import BASE_MODEL
from tests.streaming_support import URL
from tests.streaming_support import read_all
from tests.streaming_support import stream_harness

pytestmark = pytest.mark.asyncio

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def hold_next(engine: ScriptedSGLangEngine | ScriptedVllmEngine) -> ScriptedStream:
    """The engine's next stream: one chunk, then held open until the test releases it."""
    held = ScriptedStream(hold_after=1)
    engine.streams.append(held)
    return held


async def test_sglang_streams_carry_their_sessions_version_across_a_publication() -> None:
    async with stream_harness() as h:
        a = await h.publish("A")
        old = h.versioning.open_session("old")
        first = await read_all(old, Route.GENERATE, {"text": "turn 1"})
        b = await h.publish("B")
        new = h.versioning.open_session("new")
        on_b = await read_all(new, Route.GENERATE, {"text": "turn 1"})
        on_a = await read_all(old, Route.GENERATE, {"text": "turn 2"})

        assert [c.version_id for c in first + on_a] == ["A"] * 6
        assert [c.version_id for c in on_b] == ["B"] * 3
        # The version comes from the binding: the engine's chunks are passed on untouched.
        assert [c.data["text"] for c in first] == ["x", "xx", "xxx"]
        bodies = h.sglang.bodies(EngineOp.GENERATE)
        assert [b_["lora_path"] for b_ in bodies] == [a.lora_name, b.lora_name, a.lora_name]
        assert all(b_["stream"] is True and b_["rid"] for b_ in bodies)
        assert {c.rid for c in first} == {bodies[0]["rid"]}
        assert old.provenance()["lags"] == [0, 1]
        assert h.versioning.in_flight(a.lora_name) == 0
        assert old.in_flight == 0


@pytest.mark.parametrize("route", [Route.CHAT_COMPLETIONS, Route.COMPLETIONS])
async def test_vllm_streams_name_the_adapter_as_model_and_carry_the_version(route: Route) -> None:
    async with stream_harness("vllm") as h:
        a = await h.publish("A")
        s = h.versioning.open_session("S")
        request = CHAT if route is Route.CHAT_COMPLETIONS else {"prompt": "p"}
        chunks = await read_all(s, route, {**request, "model": BASE_MODEL, "stream": False})
        assert [c.version_id for c in chunks] == ["A"] * 3
        assert chunks[0].provenance is not None
        assert chunks[0].provenance.lora_name == a.lora_name
        (body,) = h.vllm.bodies(
            EngineOp.CHAT if route is Route.CHAT_COMPLETIONS else EngineOp.COMPLETION
        )
        assert body["model"] == a.lora_name
        assert body["stream"] is True  # Session.stream always streams


async def test_dispatch_with_stream_true_is_refused_before_binding() -> None:
    async with stream_harness() as h:
        await h.publish("A")
        s = h.versioning.open_session("S")
        with pytest.raises(InvalidRequestError) as err:
            await s.generate({"text": "x", "stream": True})
        assert err.value.details["reason"] == "stream"
        assert s.binding is None
        assert h.sglang.count(EngineOp.GENERATE) == 0


async def test_an_open_stream_holds_its_version_and_a_vllm_drain_waits_for_it() -> None:
    async with stream_harness("vllm") as h:
        a = await h.publish("A")
        held = hold_next(h.vllm)
        s = h.versioning.open_session("S")
        it = s.stream(Route.COMPLETIONS, {"prompt": "long"})
        first = await anext(it)
        # The reader asks for the next chunk, which the engine holds back: the stream is open
        # and waiting on the engine.
        second = asyncio.ensure_future(anext(it))
        await held.held.wait()
        assert first.version_id == "A"
        assert h.versioning.in_flight(a.lora_name) == 1
        assert s.in_flight == 1

        drained = asyncio.create_task(h.versioning.wait_drained(a.lora_name))
        # Whether the engine had sent the stream's last event when the drain returned.
        finished_at_drain: list[bool] = []
        drained.add_done_callback(lambda _: finished_at_drain.append(held.finished.is_set()))
        held.gate.set()
        rest = [await second] + [c async for c in it]
        await drained
        assert len(rest) == 2
        # The drain a vLLM reclaim waits for returned only once the engine's stream had ended.
        assert finished_at_drain == [True]
        assert h.versioning.in_flight(a.lora_name) == 0


async def test_an_sglang_unload_waits_for_an_open_stream_on_its_adapter() -> None:
    async with stream_harness() as h:
        a = await h.publish("A")
        held = hold_next(h.sglang)
        s = h.versioning.open_session("S")
        it = s.stream(Route.GENERATE, {"text": "long"})
        await anext(it)
        async with httpx.AsyncClient() as admin:
            unload = asyncio.create_task(
                admin.post(URL + "/unload_lora_adapter", json={"lora_name": a.lora_name})
            )
            await h.sglang.unload_blocked.wait()
            assert h.sglang.physical_unloads[a.lora_name] == 0
            held.gate.set()
            assert len([c async for c in it]) == 2
            assert (await unload).status_code == 200
        assert h.sglang.physical_unloads[a.lora_name] == 1


@pytest.mark.parametrize(
    ("fault", "error"),
    [
        (FaultKind.REFUSE, RequestRefusedError),
        (FaultKind.UNREACHABLE, RequestRefusedError),
        (FaultKind.SERVER_ERROR, RequestIndeterminateError),
        (FaultKind.LOSE_REPLY, RequestIndeterminateError),
    ],
)
async def test_failures_before_the_first_chunk_are_classified_as_for_a_dispatch(
    fault: FaultKind, error: type[Exception]
) -> None:
    async with stream_harness() as h:
        a = await h.publish("A")
        h.sglang.script(EngineOp.GENERATE, Fault(fault))
        s = h.versioning.open_session("S")
        it = s.stream(Route.GENERATE, {"text": "x"})
        with pytest.raises(error):
            await anext(it)
        assert h.versioning.in_flight(a.lora_name) == 0
        assert s.in_flight == 0
        # Nothing was resent, and the Session streams again.
        assert h.sglang.count(EngineOp.GENERATE) == (0 if fault is FaultKind.UNREACHABLE else 1)
        assert [c.version_id for c in await read_all(s, Route.GENERATE, {"text": "y"})] == ["A"] * 3


@pytest.mark.parametrize(
    ("status", "error"), [(400, RequestRefusedError), (500, RequestIndeterminateError)]
)
async def test_an_error_event_before_any_chunk_keeps_the_engines_status(
    status: int, error: type[Exception]
) -> None:
    async with stream_harness() as h:
        await h.publish("A")
        h.sglang.streams.append(ScriptedStream([], ending=StreamEnding.ERROR, error_status=status))
        s = h.versioning.open_session("S")
        with pytest.raises(error) as err:
            await read_all(s, Route.GENERATE, {"text": "x"})
        assert err.value.details["reason"] == "stream_error"  # type: ignore[attr-defined]


@pytest.mark.parametrize("ending", [StreamEnding.ERROR, StreamEnding.DROP, StreamEnding.EOF])
async def test_a_failure_after_the_first_chunk_delivers_the_partial_output_then_is_indeterminate(
    ending: StreamEnding,
) -> None:
    async with stream_harness() as h:
        a = await h.publish("A")
        h.sglang.streams.append(
            ScriptedStream(generate_chunks(3, None, None)[:2], ending=ending, error_status=400)
        )
        s = h.versioning.open_session("S")
        got: list[StreamChunk] = []
        with pytest.raises(RequestIndeterminateError) as err:
            await collect(s.stream(Route.GENERATE, {"text": "x"}), got)
        assert [c.data["text"] for c in got] == ["x", "xx"]
        assert err.value.details["chunks"] == 2
        assert h.sglang.count(EngineOp.GENERATE) == 1  # never resent
        assert h.versioning.in_flight(a.lora_name) == 0


@pytest.mark.parametrize("how", ["aclose", "cancel"])
async def test_a_reader_leaving_an_sglang_stream_aborts_the_request_by_id(how: str) -> None:
    async with stream_harness() as h:
        a = await h.publish("A")
        held = hold_next(h.sglang)
        s = h.versioning.open_session("S")
        if how == "aclose":
            it = s.stream(Route.GENERATE, {"text": "long"})
            await anext(it)
            await it.aclose()
        else:
            reading = asyncio.Event()

            async def reader() -> None:
                async for _ in s.stream(Route.GENERATE, {"text": "long"}):
                    reading.set()

            task = asyncio.create_task(reader())
            await reading.wait()
            await held.held.wait()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await s_drained(s)
        (sent,) = h.sglang.bodies(EngineOp.GENERATE)
        assert h.sglang.bodies(EngineOp.ABORT) == [{"rid": sent["rid"]}]
        assert held.aborted.is_set()
        assert h.versioning.in_flight(a.lora_name) == 0
        assert s.in_flight == 0
        # The Session stays usable; nothing was retried.
        chunks = await read_all(s, Route.GENERATE, {"text": "next"})
        assert [c.version_id for c in chunks] == ["A"] * 3
        assert h.sglang.count(EngineOp.GENERATE) == 2


async def collect(stream: AsyncIterator[StreamChunk], into: list[StreamChunk]) -> None:
    async for chunk in stream:
        into.append(chunk)


async def s_drained(s: object) -> None:
    """Wait until the Session's abandoned stream released its record (event-driven)."""
    await s._wait_drained()  # type: ignore[attr-defined]


async def test_a_reader_leaving_a_vllm_stream_closes_the_engine_connection() -> None:
    async with stream_harness("vllm") as h:
        a = await h.publish("A")
        held = hold_next(h.vllm)
        s = h.versioning.open_session("S")
        it = s.stream(Route.CHAT_COMPLETIONS, CHAT)
        await anext(it)
        await it.aclose()
        assert held.closed_early.is_set()  # the engine saw its client leave
        assert h.versioning.in_flight(a.lora_name) == 0
        assert len(await read_all(s, Route.CHAT_COMPLETIONS, CHAT)) == 3


async def test_close_aborts_an_open_sglang_stream_which_then_ends() -> None:
    async with stream_harness() as h:
        await h.publish("A")
        hold_next(h.sglang)
        s = h.versioning.open_session("S")
        it = s.stream(Route.GENERATE, {"text": "long"})
        await anext(it)
        closing = asyncio.create_task(s.close())
        rest = [c async for c in it]
        result = await closing
        assert rest[-1].data["meta_info"]["finish_reason"] == {"type": "abort"}
        assert result is not None
        assert result.version_id == "A"


async def test_nothing_is_read_ahead_of_the_reader() -> None:
    async with stream_harness() as h:
        await h.publish("A")
        engine = h.sglang
        many = ScriptedStream(generate_chunks(200, "r1", None))
        engine.streams.append(many)
        endpoint = StreamEndpoint(h.transport)

        async def chain(call: EngineCall) -> object:
            return await endpoint(call.routed_to("e0"))

        flight = InFlight("r1")
        call = EngineCall(Route.GENERATE, {"text": "x", "stream": True, "rid": "r1"}, ticket=flight)
        upstream = UpstreamStream(chain, call, h.transport, can_abort=True)  # type: ignore[arg-type]
        it = upstream.__aiter__()
        await anext(it)
        # Other work on the loop while the reader holds back: a reader-side read-ahead (a task
        # filling a buffer) would run meanwhile; here nothing reads until the reader asks.
        other = h.versioning.open_session("other")
        reply = await other.dispatch(Route.GENERATE, {"text": "y"})
        assert reply.status_code == 200
        await other.close()
        # One taken, at most one line ahead in httpx.
        assert many.sent <= 2
        assert upstream.handoff.delivered == 1
        rest = [c async for c in it]
        assert len(rest) == 199
        assert many.sent == 200
        await upstream.aclose()
