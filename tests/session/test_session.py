"""Session binding and dispatch against the real LocalRegistry and respx-mocked SGLang engines.

Every claim about what an engine received is asserted on the request bodies that reached the
mocked engines.
"""

from __future__ import annotations

import asyncio

import pytest

from agentic_lora.errors import AdapterMismatchError
from agentic_lora.errors import InvalidRequestError
from agentic_lora.errors import NoPublishedVersionError
from agentic_lora.errors import RequestIndeterminateError
from agentic_lora.errors import RequestRefusedError
from agentic_lora.errors import SessionStateError
from agentic_lora.errors import VersionNotDispatchableError
from agentic_lora.registry.types import Binding
from agentic_lora.registry.types import VersionState
from agentic_lora.registry.types import new_request_id
from agentic_lora.session import Session
from agentic_lora.session import SessionPhase
from agentic_lora.session import Versioning
from tests.session_support import BASE_MODEL
from tests.session_support import commit
from tests.session_support import harness
from tests.session_support import publish
from tests.session_support import ready
from tests.session_support import stage

pytestmark = pytest.mark.asyncio


def binding_of(s: Session) -> Binding | None:
    # A function call, so a type checker does not carry an earlier narrowing across awaits.
    return s.binding


def turn(tag: str, n: int) -> dict[str, object]:
    return {"text": f"{tag} turn {n}", "sampling_params": {"max_new_tokens": 8}}


async def test_old_mid_new_sessions_keep_their_versions_across_turns_retries_and_resume() -> None:
    async with harness() as h:
        reg, eng, v = h.registry, h.engines, h.versioning
        a = await publish(reg, "A")
        s_old, s_mid, s_new = (v.open_session(n) for n in ("S_old", "S_mid", "S_new"))

        await s_old.generate(turn("S_old", 1))  # binds before B exists

        b = await stage(reg, "B", engines=("e0",))  # only E0 is READY for B
        await s_mid.generate(turn("S_mid", 1))
        assert (await reg.status()).default_version == "A"

        await ready(reg, b, ("e1",))
        await commit(reg, b)  # A -> RETIRED, B -> PUBLISHED
        await s_new.generate(turn("S_new", 1))

        # Later tool turns, on both routes.
        for n in (2, 3):
            await s_old.generate(turn("S_old", n))
            await s_mid.generate(turn("S_mid", n))
        await s_mid.chat_completions({"messages": [{"role": "user", "content": "S_mid chat"}]})

        # Retries after a refused and an indeterminate failure.
        eng.actions.extend([400, "lose"])
        with pytest.raises(RequestRefusedError):
            await s_old.generate(turn("S_old", 4))
        with pytest.raises(RequestIndeterminateError):
            await s_mid.generate(turn("S_mid", 4))
        await s_old.generate(turn("S_old", 5))
        await s_mid.generate(turn("S_mid", 5))

        # Temporary abort, then resume.
        eng.actions.append("hold")
        pending = asyncio.create_task(s_old.generate(turn("S_old", 6)))
        (held,) = await eng.wait_held(1)
        assert held.rid is not None
        assert await s_old.abort(held.rid)
        aborted = await pending
        assert aborted.aborted
        assert s_old.binding is not None
        assert s_old.binding.version_id == "A"
        await s_old.generate(turn("S_old", 7))

        await s_new.generate(turn("S_new", 2))

    sent: dict[str, set[str]] = {"S_old": set(), "S_mid": set(), "S_new": set()}
    for s in eng.generations(path="/generate"):
        sent[str(s.body["text"]).split()[0]].add(s.body["lora_path"])
    assert sent == {"S_old": {a.lora_name}, "S_mid": {a.lora_name}, "S_new": {b.lora_name}}
    (chat,) = eng.generations(path="/v1/chat/completions")
    assert chat.body["model"] == f"{BASE_MODEL}:{a.lora_name}"
    # Every turn of every session went out once per call, the lost one included.
    assert len([s for s in eng.generations() if "S_old" in str(s.body.get("text"))]) == 7
    assert reg.calls["bind_first"] == 3  # one per Session; no later request read the default


async def test_hundred_concurrent_first_generations_bind_once_and_cancelled_waiters_do_not_unbind() -> (
    None
):
    async with harness() as h:
        reg, eng = h.registry, h.engines
        a = await publish(reg, "A")
        s = h.versioning.open_session("S")
        gate = reg.gate("bind_first")
        tasks = [asyncio.create_task(s.generate(turn("S", i))) for i in range(100)]
        await reg.entered["bind_first"].wait()
        for t in tasks[:30]:
            t.cancel()
        gate.set()
        results = await asyncio.gather(*tasks, return_exceptions=True)

        assert all(isinstance(r, asyncio.CancelledError) for r in results[:30])
        assert all(r.status_code == 200 for r in results[30:])  # type: ignore[union-attr]
        assert reg.calls["bind_first"] == 1
        assert len(eng.generations()) == 70
        assert {g.body["lora_path"] for g in eng.generations()} == {a.lora_name}
        status = reg.peek_version("A")
        assert status is not None
        assert status.session_refs == 1
        assert s.phase is SessionPhase.BOUND


async def test_cancelling_every_waiter_still_completes_the_binding() -> None:
    async with harness() as h:
        reg = h.registry
        a = await publish(reg, "A")
        s = h.versioning.open_session("S")
        gate = reg.gate("bind_first")
        tasks = [asyncio.create_task(s.generate(turn("S", i))) for i in range(5)]
        await reg.entered["bind_first"].wait()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert binding_of(s) is None
        b = await stage(reg, "B")
        gate.set()
        await reg.returned.setdefault("bind_first", asyncio.Event()).wait()
        await commit(reg, b)  # the default moves on; the Session must not follow it

        reply = await s.generate(turn("S", 9))
        assert reg.calls["bind_first"] == 1
        assert s.binding is not None
        assert s.binding.lora_name == a.lora_name
        assert h.engines.generations()[-1].body["lora_path"] == a.lora_name
        assert reply.status_code == 200


async def test_no_published_version_then_the_same_bind_request_is_replayed() -> None:
    async with harness() as h:
        reg = h.registry
        s = h.versioning.open_session("S")
        with pytest.raises(NoPublishedVersionError):
            await s.generate(turn("S", 1))
        assert h.engines.sent == []
        a = await publish(reg, "A")
        await s.generate(turn("S", 2))
        ids = reg.request_ids("bind_first")
        assert len(ids) == 2
        assert ids[0] == ids[1]
        assert h.engines.generations()[0].body["lora_path"] == a.lora_name


async def test_lost_bind_reply_is_replayed_and_keeps_the_first_answer() -> None:
    async with harness() as h:
        reg = h.registry
        a = await publish(reg, "A")
        s = h.versioning.open_session("S")
        reg.lose_reply["bind_first"] = 1  # the registry bound S to A; the reply is lost
        with pytest.raises(RequestRefusedError) as err:
            await s.generate(turn("S", 1))
        assert err.value.details["stage"] == "bind"
        assert h.engines.sent == []
        await publish(reg, "B")  # a fresh choice now would be B
        await s.generate(turn("S", 2))
        ids = reg.request_ids("bind_first")
        assert len(ids) == 2
        assert ids[0] == ids[1]
        assert h.engines.generations()[0].body["lora_path"] == a.lora_name
        status = reg.peek_version("A")
        assert status is not None
        assert status.session_refs == 1


async def test_reply_lost_after_the_engine_accepted_is_indeterminate_and_sent_once() -> None:
    async with harness(published="A") as h:
        s = h.versioning.open_session("S")
        h.engines.actions.append("lose")
        with pytest.raises(RequestIndeterminateError) as err:
            await s.generate(turn("S", 1))
        assert len(h.engines.generations()) == 1
        assert err.value.code == "REQUEST_INDETERMINATE"
        assert "indeterminate" in str(err.value)
        assert err.value.details["engine"] == h.engines.generations()[0].engine


async def test_dispatch_after_reclaiming_never_reaches_an_engine() -> None:
    async with harness() as h:
        reg = h.registry
        await publish(reg, "A")
        s = h.versioning.open_session("S")
        await s.generate(turn("S", 1))
        await publish(reg, "B")  # A -> RETIRED, still held by S
        # The registry side ends S (e.g. an operator or a reaper), then A is reclaimed.
        await reg.begin_close(request_id=new_request_id(), session_key=s.key)
        await reg.release(request_id=new_request_id(), session_key=s.key)
        await reg.claim_reclaim(request_id=new_request_id(), version_id="A")
        status = reg.peek_version("A")
        assert status is not None
        assert status.state is VersionState.RECLAIMING
        before = len(h.engines.sent)
        with pytest.raises(VersionNotDispatchableError) as err:
            await s.generate(turn("S", 2))
        assert err.value.details["state"] == "RECLAIMING"
        assert len(h.engines.sent) == before


async def test_a_caller_naming_another_adapter_is_refused_before_sending() -> None:
    async with harness() as h:
        a = await publish(h.registry, "A")
        s = h.versioning.open_session("S")
        with pytest.raises(AdapterMismatchError):
            await s.generate({"text": "x", "lora_path": "policy_lora"})
        with pytest.raises(AdapterMismatchError):
            await s.chat_completions(
                {"model": f"{BASE_MODEL}:other", "messages": [{"role": "user", "content": "x"}]}
            )
        assert h.engines.sent == []
        # The bound name itself is accepted, bare or explicit, and always sent explicit.
        await s.generate({"text": "x", "lora_path": a.lora_name})
        await s.completions({"model": a.lora_name, "prompt": "x"})
        gen, comp = h.engines.generations()
        assert gen.body["lora_path"] == a.lora_name
        assert comp.body["model"] == f"{BASE_MODEL}:{a.lora_name}"


async def test_malformed_and_streaming_requests_are_refused_without_binding() -> None:
    async with harness(published="A") as h:
        s = h.versioning.open_session("S")
        with pytest.raises(InvalidRequestError):
            await s.generate({"text": ["a", "b"]})
        with pytest.raises(InvalidRequestError):
            await s.generate({"text": "x", "stream": True})
        assert h.registry.calls["bind_first"] == 0
        assert h.engines.sent == []


async def test_a_session_checks_the_shape_it_relies_on_and_leaves_values_to_the_engine() -> None:
    async with harness(published="A") as h:
        s = h.versioning.open_session("S")
        for bad in ({"text": "x", "rid": ["r1", "r2"]}, {"input_ids": [[1], [2]]}, {"rid": "r"}):
            with pytest.raises(InvalidRequestError) as err:
                await s.generate(bad)
            assert err.value.details["problems"]
        assert h.registry.calls["bind_first"] == 0
        assert h.engines.sent == []
        # A sampling value is the engine's to judge: the body goes out exactly as given.
        body = {"text": "x", "sampling_params": {"temperature": -1}, "engine_flag": [1]}
        await s.generate(body)
        (sent,) = h.engines.generations()
        assert sent.body["sampling_params"] == {"temperature": -1}
        assert sent.body["engine_flag"] == [1]


async def test_a_session_injects_a_request_id_and_keeps_the_callers() -> None:
    async with harness(published="A") as h:
        s = h.versioning.open_session("S")
        r1 = await s.generate({"text": "x"})
        r2 = await s.generate({"text": "y", "rid": "caller-rid"})
        g1, g2 = h.engines.generations()
        assert isinstance(g1.body["rid"], str)
        assert g1.body["rid"] == r1.rid
        assert g2.body["rid"] == "caller-rid" == r2.rid


async def test_a_session_continued_by_key_gets_the_binding_the_registry_holds() -> None:
    async with harness() as h:
        reg, eng = h.registry, h.engines
        a = await publish(reg, "A")
        first = h.versioning.open_session("agent")
        await first.generate(turn("agent", 1))
        await publish(reg, "B")
        # A second manager (a restarted gateway) continues the same registry Session by its key.
        other = Versioning(transport=h.transport, registry=reg, base_model=BASE_MODEL)
        again = other.open_session("agent", session_key=first.key)
        assert again.key == first.key
        await again.generate(turn("agent", 2))
        assert again.binding == first.binding
        assert {g.body["lora_path"] for g in eng.generations()} == {a.lora_name}
        assert reg.calls["bind_first"] == 2  # the second one answered the first binding
        assert reg.peek_version("A").session_refs == 1  # type: ignore[union-attr]
        with pytest.raises(SessionStateError):  # one live Session object per key
            other.open_session("agent-2", session_key=first.key)
        for bad in ("", "has space", "tab\tkey", 7):
            with pytest.raises(InvalidRequestError):
                other.open_session("agent-3", session_key=bad)  # type: ignore[arg-type]
        result = await again.close()
        assert result is not None
        assert result.released_now
        # Closed and forgotten: a key the registry no longer knows is simply a new Session.
        reopened = other.open_session("agent-4", session_key=first.key)
        await reopened.generate(turn("agent", 3))
        assert reopened.binding is not None
        assert reopened.binding.version_id == "B"
        await other.aclose()
