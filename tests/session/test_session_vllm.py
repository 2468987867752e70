"""Sessions on vLLM engines, and the per-adapter in-flight count every Versioning keeps.

Against the real LocalRegistry and respx-mocked engines: what reached the engines is asserted on
the request bodies they received. Concurrency is driven by held generations and events.
"""

from __future__ import annotations

import asyncio

import pytest

from agentic_lora.errors import AdapterMismatchError
from agentic_lora.errors import ConfigurationError
from agentic_lora.errors import InvalidRequestError
from agentic_lora.errors import RequestIndeterminateError
from agentic_lora.errors import VersionNotDispatchableError
from agentic_lora.registry.types import new_request_id
from agentic_lora.session import Versioning
from tests.session_support import BASE_MODEL
from tests.session_support import harness
from tests.session_support import publish

pytestmark = pytest.mark.asyncio

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


async def test_vllm_sessions_name_their_adapter_as_the_model_across_a_publication() -> None:
    async with harness(engine_kind="vllm") as h:
        a = await publish(h.registry, "A")
        old = h.versioning.open_session("old")
        await old.completions({"prompt": "old 1", "model": BASE_MODEL})
        b = await publish(h.registry, "B")
        new = h.versioning.open_session("new")
        await new.chat_completions(CHAT)
        await old.chat_completions({**CHAT, "model": f"{BASE_MODEL}:{a.lora_name}"})
        await old.completions({"prompt": "old 2", "lora_path": a.lora_name})

        sent = [(s.path, s.body) for s in h.engines.generations()]
        assert [(path, body["model"]) for path, body in sent] == [
            ("/v1/completions", a.lora_name),
            ("/v1/chat/completions", b.lora_name),
            ("/v1/chat/completions", a.lora_name),
            ("/v1/completions", a.lora_name),
        ]
        # vLLM ignores lora_path, so it is never sent: only `model` selects the adapter.
        assert all("lora_path" not in body for _, body in sent)


async def test_generate_on_vllm_is_refused_before_binding_and_nothing_is_sent() -> None:
    async with harness(engine_kind="vllm", published="A") as h:
        s = h.versioning.open_session("S")
        with pytest.raises(InvalidRequestError) as err:
            await s.generate({"text": "x"})
        assert err.value.details == {
            "route": "/generate",
            "engine_kind": "vllm",
            "reason": "route_unsupported",
        }
        assert h.registry.calls["bind_first"] == 0
        assert s.binding is None
        assert h.engines.sent == []


async def test_a_vllm_request_naming_another_adapter_is_refused_and_not_counted() -> None:
    async with harness(engine_kind="vllm") as h:
        a = await publish(h.registry, "A")
        s = h.versioning.open_session("S")
        await s.completions({"prompt": "bind"})
        with pytest.raises(AdapterMismatchError):
            await s.completions({"prompt": "x", "model": "other-adapter"})
        assert h.versioning.in_flight(a.lora_name) == 0
        assert len(h.engines.sent) == 1


async def test_vllm_sessions_cannot_abort_and_close_drains_without_an_abort_route() -> None:
    async with harness(engine_kind="vllm", published="A") as h:
        s = h.versioning.open_session("S")
        h.engines.actions.append("hold")
        pending = asyncio.create_task(s.completions({"prompt": "long"}))
        (held,) = await h.engines.wait_held(1)
        assert held.rid is not None
        with pytest.raises(InvalidRequestError) as err:
            await s.abort(held.rid)
        assert err.value.details["reason"] == "abort_unsupported"

        closing = asyncio.create_task(s.close())
        waiting = asyncio.create_task(s.close_waits.wait())
        done, _ = await asyncio.wait({closing, waiting}, return_when=asyncio.FIRST_COMPLETED)
        assert done == {waiting}, "close ended while its request was still running"
        # Close is past the point where SGLang's would have aborted: nothing was sent, and the
        # request is still running.
        assert h.engines.aborts == []
        assert not pending.done()
        assert h.registry.calls["release"] == 0
        h.engines.release(held)
        reply = await pending
        result = await closing
        assert (reply.status_code, reply.aborted) == (200, False)  # it ran to its own end
        assert result is not None
        assert result.released_now
        assert h.engines.aborts == []


async def test_wait_drained_returns_when_the_last_request_on_the_adapter_ends() -> None:
    async with harness() as h:
        a = await publish(h.registry, "A")
        v = h.versioning
        await v.wait_drained(a.lora_name)  # nothing in flight: returns at once
        s1, s2 = v.open_session("S1"), v.open_session("S2")
        h.engines.actions.extend(["hold", "hold"])
        first = asyncio.create_task(s1.generate({"text": "one"}))
        second = asyncio.create_task(s2.generate({"text": "two"}))
        held = await h.engines.wait_held(2)
        assert v.in_flight(a.lora_name) == 2
        drained = asyncio.create_task(v.wait_drained(a.lora_name))

        h.engines.release(next(x for x in held if x.rid == rid_of(h, "one")))
        await first
        assert v.in_flight(a.lora_name) == 1
        assert not drained.done()  # one request on A is still running

        h.engines.release(next(x for x in held if x.rid == rid_of(h, "two")))
        await second
        await drained
        assert v.in_flight(a.lora_name) == 0


def rid_of(h: object, text: str) -> str:
    """The rid the engine saw on the generation whose prompt is ``text``."""
    sent = [s for s in h.engines.sent if s.body.get("text") == text]  # type: ignore[attr-defined]
    rid = sent[0].body["rid"]
    assert isinstance(rid, str)
    return rid


async def test_failed_and_cancelled_requests_leave_the_count() -> None:
    async with harness() as h:
        a = await publish(h.registry, "A")
        v = h.versioning
        s = v.open_session("S")
        h.engines.actions.append(503)
        with pytest.raises(RequestIndeterminateError):
            await s.generate({"text": "fails"})
        assert v.in_flight(a.lora_name) == 0

        h.engines.actions.append("hold")
        pending = asyncio.create_task(s.generate({"text": "cancelled"}))
        await h.engines.wait_held(1)
        assert v.in_flight(a.lora_name) == 1
        pending.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pending
        assert v.in_flight(a.lora_name) == 0
        await v.wait_drained(a.lora_name)


async def test_a_request_the_guard_refuses_is_never_counted() -> None:
    async with harness() as h:
        a = await publish(h.registry, "A")
        s = h.versioning.open_session("S")
        await s.generate({"text": "bind"})
        await publish(h.registry, "B")
        await h.registry.begin_close(request_id=new_request_id(), session_key=s.key)
        await h.registry.release(request_id=new_request_id(), session_key=s.key)
        await h.registry.claim_reclaim(request_id=new_request_id(), version_id="A")
        with pytest.raises(VersionNotDispatchableError):
            await s.generate({"text": "late"})
        assert h.versioning.in_flight(a.lora_name) == 0
        assert [x.body["text"] for x in h.engines.sent] == ["bind"]


async def test_an_unknown_engine_kind_is_a_configuration_error() -> None:
    async with harness() as h:
        with pytest.raises(ConfigurationError) as err:
            Versioning(transport=h.transport, registry=h.registry, engine_kind="trt")  # type: ignore[arg-type]
        assert err.value.details["check"] == "engine_kind"
        assert h.versioning.dialect.name == "sglang"
