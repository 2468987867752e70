"""Session close: FINALIZING, begin_close, bind settles, abort + drain, release once, forget."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from tenacity import wait_none

from agentic_lora.errors import SessionClosedError
from agentic_lora.errors import SessionReleaseError
from agentic_lora.errors import SessionStateError
from agentic_lora.foundation.replay import RegistryRetry
from agentic_lora.session import TRANSITIONS
from agentic_lora.session import Session
from agentic_lora.session import SessionPhase
from agentic_lora.session import next_phase
from tests.session_support import Harness
from tests.session_support import harness
from tests.session_support import publish


@pytest_asyncio.fixture
async def h() -> AsyncIterator[Harness]:
    """The harness with A published."""
    async with harness(published="A") as h:
        yield h


@pytest.fixture
def s(h: Harness) -> Session:
    """Session "S", open and not bound yet."""
    return h.versioning.open_session("S")


def phase_of(s: Session) -> SessionPhase:
    # A function call, so a type checker does not carry an earlier narrowing across awaits.
    return s.phase


@pytest.mark.asyncio
async def test_close_before_bind_binds_nothing_and_later_dispatch_is_session_closed(
    h: Harness, s: Session
) -> None:
    result = await s.close()
    assert result is not None
    assert result.version_id is None
    assert result.released_now
    assert s.phase is SessionPhase.CLOSED
    assert not s.close_waits.is_set()  # nothing was in flight
    with pytest.raises(SessionClosedError):
        await s.generate({"text": "late"})
    assert h.registry.calls["bind_first"] == 0
    assert h.refs("A") == 0
    assert h.engines.sent == []


@pytest.mark.asyncio
async def test_duplicate_and_concurrent_closes_release_exactly_once(h: Harness, s: Session) -> None:
    await s.generate({"text": "x"})
    assert h.refs("A") == 1
    first, second = await asyncio.gather(s.close(), s.close())
    third = await s.close()
    assert first is second is third
    assert first is not None
    assert first.version_id == "A"
    assert first.released_now
    assert h.registry.calls["begin_close"] == 1
    assert h.registry.calls["release"] == 1
    assert h.refs("A") == 0


@pytest.mark.asyncio
async def test_late_bind_after_begin_close_is_refused_and_nothing_is_held(
    h: Harness, s: Session
) -> None:
    gate = h.registry.gate("bind_first")
    first_gen = asyncio.create_task(s.generate({"text": "x"}))
    await h.registry.entered["bind_first"].wait()  # the bind is on its way to the registry
    closing = asyncio.create_task(s.close())
    # begin_close reaches the registry before the delayed bind does.
    await h.registry.seen("begin_close").wait()
    gate.set()
    with pytest.raises(SessionClosedError):
        await first_gen
    result = await closing
    assert result is not None
    assert result.version_id is None
    assert [v for _, v, _ in h.registry.log if v in ("begin_close", "bind_first")] == [
        "bind_first",
        "begin_close",
    ]  # the bind call was issued first, but the registry ran begin_close first
    assert h.refs("A") == 0
    assert h.engines.sent == []


@pytest.mark.asyncio
async def test_bind_that_won_the_race_is_released_by_close(h: Harness, s: Session) -> None:
    h.registry.lose_reply["bind_first"] = 1  # bound at the registry, reply lost here
    with pytest.raises(Exception, match="binding was not confirmed"):
        await s.generate({"text": "x"})
    assert s.binding is None
    assert h.refs("A") == 1
    result = await s.close()
    assert result is not None
    assert result.version_id == "A"
    assert result.released_now
    assert h.refs("A") == 0


@pytest.mark.asyncio
async def test_release_failure_is_retried_with_the_same_request_id(h: Harness, s: Session) -> None:
    await s.generate({"text": "x"})
    h.registry.fail_before["release"] = 1
    h.registry.lose_reply["release"] = 1  # the second try runs, its reply is lost
    result = await s.close()
    ids = h.registry.request_ids("release")
    assert len(ids) == 3
    assert len(set(ids)) == 1
    assert result is not None
    assert result.version_id == "A"
    # The third call replays the second: the registry hands back the original answer and the
    # ref was dropped once (a second drop would make it negative).
    assert result.released_now is True
    assert h.refs("A") == 0


@pytest.mark.asyncio
async def test_failed_release_keeps_the_record_and_close_can_be_retried() -> None:
    async with harness(
        registry_retry=RegistryRetry(attempts=2, wait=wait_none()), published="A"
    ) as h:
        s = h.versioning.open_session("S")
        await s.generate({"text": "x"})
        h.registry.fail_before["release"] = 5
        with pytest.raises(SessionReleaseError) as err:
            await s.close()
        assert err.value.code == "SESSION_RELEASE_FAILED"
        assert err.value.details["stage"] == "release"
        assert s.phase is SessionPhase.FINALIZING
        assert h.versioning.get("S") is s
        assert h.refs("A") == 1
        with pytest.raises(SessionClosedError):
            await s.generate({"text": "no new dispatch while finalizing"})
        with pytest.raises(SessionStateError):
            h.versioning.open_session("S")  # the id is still taken by the unfinished lifecycle

        h.registry.fail_before["release"] = 0
        result = await s.close()
        assert result is not None
        assert result.released_now
        assert len(set(h.registry.request_ids("release"))) == 1
        assert h.registry.calls["begin_close"] == 2  # replayed with its own request id
        assert len(set(h.registry.request_ids("begin_close"))) == 1
        assert h.refs("A") == 0
        assert h.versioning.get("S") is None
        assert phase_of(s) is SessionPhase.CLOSED


@pytest.mark.asyncio
async def test_close_aborts_and_drains_in_flight_before_release_then_forgets(
    h: Harness, s: Session
) -> None:
    h.engines.actions.extend(["hold", "hold"])
    t1 = asyncio.create_task(s.generate({"text": "long 1"}))
    t2 = asyncio.create_task(s.generate({"text": "long 2"}))
    held = await h.engines.wait_held(2)
    assert s.in_flight == 2
    result = await s.close()
    r1, r2 = await asyncio.gather(t1, t2)
    assert r1.aborted
    assert r2.aborted
    aborted = {(a.engine, a.body["rid"]) for a in h.engines.aborts}
    assert aborted == {(x.engine, x.rid) for x in held}
    release_at = next(seq for seq, v, _ in h.registry.log if v == "release")
    assert max(a.seq for a in h.engines.aborts) < release_at
    assert result is not None
    assert result.version_id == "A"
    forget = [kw for _, v, kw in h.registry.log if v == "forget_sessions"]
    assert forget
    assert s.key in forget[-1]["session_keys"]
    assert (await h.registry.status()).live_sessions == 0
    assert h.versioning.get("S") is None


@pytest.mark.asyncio
async def test_context_manager_closes_even_when_the_block_raises(h: Harness) -> None:
    async def episode() -> None:
        async with h.versioning.session("S") as s:
            opened.append(s)
            await s.generate({"text": "x"})
            raise RuntimeError("agent crashed")

    opened: list[Session] = []
    with pytest.raises(RuntimeError, match="agent crashed"):
        await episode()
    (s,) = opened
    assert s.phase is SessionPhase.CLOSED
    assert h.refs("A") == 0


@pytest.mark.asyncio
async def test_reused_session_id_is_a_new_lifecycle(h: Harness) -> None:
    async with h.versioning.session("S") as first:
        await first.generate({"text": "x"})
    await publish(h.registry, "B")
    async with h.versioning.session("S") as second:
        await second.generate({"text": "y"})
    assert first.key != second.key
    assert first.binding is not None
    assert second.binding is not None
    assert (first.binding.version_id, second.binding.version_id) == ("A", "B")


@pytest.mark.asyncio
async def test_forget_failure_is_retried_with_the_next_close(h: Harness) -> None:
    h.registry.fail_before["forget_sessions"] = 1
    async with h.versioning.session("S1") as s1:
        await s1.generate({"text": "x"})
    async with h.versioning.session("S2") as s2:
        await s2.generate({"text": "y"})
    calls = [kw["session_keys"] for _, v, kw in h.registry.log if v == "forget_sessions"]
    assert calls == [[s1.key], [s1.key, s2.key]]
    assert (await h.registry.status()).live_sessions == 0


def test_transition_table_allows_only_the_documented_moves() -> None:
    legal = {(a, b) for a, targets in TRANSITIONS.items() for b in targets}
    assert legal == {
        (SessionPhase.OPEN, SessionPhase.BOUND),
        (SessionPhase.OPEN, SessionPhase.FINALIZING),
        (SessionPhase.BOUND, SessionPhase.FINALIZING),
        (SessionPhase.FINALIZING, SessionPhase.CLOSED),
    }
    for a in SessionPhase:
        for b in SessionPhase:
            if (a, b) in legal:
                assert next_phase(a, b) is b
            else:
                with pytest.raises(SessionStateError):
                    next_phase(a, b)
