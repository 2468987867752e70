"""A Session's close in one synchronous step (``SessionCloser.close_session_now``), taken only
when nothing is left to wait for; every other close goes through the verbs (test_session_close)."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import AsyncIterator
from collections.abc import Coroutine
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from typing import TypeVar

import pytest
from tenacity import wait_none

from agentic_lora.errors import SessionClosedError
from agentic_lora.foundation.replay import RegistryRetry
from agentic_lora.registry.api import session_closer
from agentic_lora.registry.local import LocalRegistry
from agentic_lora.registry.types import Binding
from agentic_lora.registry.types import ReleaseResult
from agentic_lora.registry.types import SessionStatus
from agentic_lora.registry.types import new_request_id
from agentic_lora.session import SessionPhase
from agentic_lora.session import Versioning
from tests.session_support import BASE_MODEL
from tests.session_support import Harness
from tests.session_support import harness
from tests.session_support import publish

pytestmark = pytest.mark.asyncio

T = TypeVar("T")

BODY = {"text": "hi", "sampling_params": {"max_new_tokens": 4}}


def run_without_suspending(coro: Coroutine[Any, Any, T]) -> T:
    """Drive ``coro`` by one step: it must finish there, never handing the loop a chance to run
    anything else (so no caller cancellation can land inside it)."""
    with pytest.raises(StopIteration) as done:
        coro.send(None)
    value: T = done.value.value
    return value


def window(registry: LocalRegistry) -> int:
    """How many request ids the registry remembers (its idempotency window, from its image)."""
    return len(registry.core.to_state()["done"])


@asynccontextmanager
async def direct(
    h: Harness, registry: LocalRegistry | None = None, **options: Any
) -> AsyncIterator[Versioning]:
    """A Versioning on the harness's engines over a registry itself (no recorder in between)."""
    versioning = Versioning(
        transport=h.transport,
        registry=registry if registry is not None else h.inner,
        base_model=BASE_MODEL,
        registry_retry=RegistryRetry(attempts=4, wait=wait_none()),
        **options,
    )
    try:
        yield versioning
    finally:
        await versioning.aclose()


async def test_a_bound_session_with_nothing_in_flight_closes_in_one_step() -> None:
    async with harness() as h, direct(h) as versioning:
        heard: list[tuple[str, type]] = []
        h.inner.add_listener(lambda verb, result: heard.append((verb, type(result))))
        await publish(h.registry, "A")
        s = versioning.open_session("s1")
        await s.generate(BODY)
        assert s.phase is SessionPhase.BOUND
        assert h.refs("A") == 1
        remembered, seq = window(h.inner), h.inner.core.seq
        heard.clear()

        result = run_without_suspending(s.close())

        assert result == ReleaseResult(s.key, "A", released_now=True)
        assert s.phase is SessionPhase.CLOSED
        assert s.release_result is result
        assert h.refs("A") == 0
        assert h.inner.core.session(s.key) is None  # the tombstone is forgotten too
        assert versioning.get("s1") is None
        assert versioning.live_sessions() == ()
        # Listeners hear the three verbs in their order; no request id is remembered for them.
        assert heard == [
            ("begin_close", SessionStatus),
            ("release", ReleaseResult),
            ("forget_sessions", int),
        ]
        assert (window(h.inner), h.inner.core.seq) == (remembered, seq + 3)
        # A closed Session stays closed: the same result, nothing more asked of the registry.
        assert run_without_suspending(s.close()) is result
        assert h.inner.core.seq == seq + 3
        with pytest.raises(SessionClosedError):
            await s.generate(BODY)


async def test_a_session_closed_before_its_bind_answers_as_through_the_verbs() -> None:
    async with harness(published="A") as h, direct(h) as versioning:
        now = versioning.open_session("early")
        result = run_without_suspending(now.close())
        # The same Session closed through the verbs (the recorder sends every verb).
        through_verbs = h.versioning.open_session("early")
        assert await through_verbs.close() == ReleaseResult(through_verbs.key, None, True)
        assert h.registry.calls["begin_close"] == h.registry.calls["release"] == 1
        assert result == ReleaseResult(now.key, None, released_now=True)
        assert h.inner.core.session(now.key) is None
        assert h.refs("A") == 0


async def test_a_pass_through_session_closes_in_one_step() -> None:
    async with harness(enabled=False) as h:
        s = h.versioning.open_session("p")
        await s.generate({**BODY, "lora_path": "legacy"})
        assert run_without_suspending(s.close()) is None
        assert s.phase is SessionPhase.CLOSED
        assert h.versioning.get("p") is None


async def test_a_request_in_flight_makes_close_abort_and_drain_first() -> None:
    async with harness(published="A") as h, direct(h) as versioning:
        s = versioning.open_session("busy")
        h.engines.actions.append("hold")
        generation = asyncio.create_task(s.generate(BODY))
        [held] = await h.engines.wait_held()
        result = await s.close()
        assert (await generation).aborted  # ended by close's abort, before the release
        assert [(a.engine, a.body["rid"]) for a in h.engines.aborts] == [(held.engine, held.rid)]
        assert result == ReleaseResult(s.key, "A", released_now=True)
        assert h.refs("A") == 0
        assert h.inner.core.session(s.key) is None


class GatedBind(LocalRegistry):
    """The real registry with a gate in front of ``bind_first`` (a slow bind)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.bind_entered = asyncio.Event()
        self.bind_gate = asyncio.Event()

    async def bind_first(self, **kwargs: Any) -> Binding:
        self.bind_entered.set()
        await self.bind_gate.wait()
        return await super().bind_first(**kwargs)


async def test_a_bind_in_flight_makes_close_wait_for_it() -> None:
    async with harness() as h:
        registry = GatedBind(engines=("e0", "e1"), capacity=2)
        closing_seen = asyncio.Event()
        registry.add_listener(lambda verb, _: closing_seen.set() if verb == "begin_close" else None)
        async with direct(h, registry) as versioning:
            await publish(registry, "A")
            s = versioning.open_session("binding")
            generation = asyncio.create_task(s.generate(BODY))
            await registry.bind_entered.wait()
            closing = asyncio.create_task(s.close())
            await closing_seen.wait()  # begin_close went through the verbs, before the bind
            assert not closing.done()  # it waits for the bind, and never cancels it
            registry.bind_gate.set()
            result = await closing
            with pytest.raises(SessionClosedError):
                await generation  # the late bind was refused: nothing held, nothing sent
            assert h.engines.generations() == []
            assert result == ReleaseResult(s.key, None, released_now=True)
            assert registry.peek_version("A").session_refs == 0  # type: ignore[union-attr]
            assert registry.core.session(s.key) is None
        await registry.aclose()


async def test_a_journaled_registry_closes_through_the_verbs_and_journals_them(
    tmp_path: Path,
) -> None:
    async with harness() as h:
        journal = tmp_path / "registry.db"
        registry = LocalRegistry(engines=("e0", "e1"), capacity=2, journal_path=journal)
        assert registry.close_session_now("never-opened") is None  # a row to make durable first
        async with direct(h, registry) as versioning:
            await publish(registry, "A")
            s = versioning.open_session("kept")
            await s.generate(BODY)
            assert await s.close() == ReleaseResult(s.key, "A", released_now=True)
        await registry.aclose()
        restarted = LocalRegistry(engines=("e0", "e1"), capacity=2, journal_path=journal)
        try:
            assert restarted.peek_version("A").session_refs == 0  # type: ignore[union-attr]
            assert restarted.core.session(s.key) is None
        finally:
            await restarted.aclose()


async def test_the_one_step_close_is_offered_by_the_local_registry_only_while_it_runs() -> None:
    registry = LocalRegistry(engines=("e0",), capacity=2)
    assert session_closer(registry) is registry
    await registry.aclose()
    assert registry.close_session_now("late") is None  # closed: nothing applied
    assert registry.core.session("late") is None


async def test_the_one_step_close_answers_every_record_state_as_release_does() -> None:
    now = [1000.0]
    registry = LocalRegistry(
        engines=("e0", "e1"), capacity=2, clock=lambda: now[0], sweep_interval=None
    )
    try:
        await publish(registry, "A")
        lease = await registry.open_lease(
            request_id=new_request_id(), owner="w", incarnation="1", ttl=1.0
        )
        for key in ("bound", "closing", "closed"):
            await registry.bind_first(request_id=new_request_id(), session_key=key)
        await registry.bind_first(
            request_id=new_request_id(), session_key="expired", lease=lease.lease_id
        )
        for key in ("closing", "closed"):
            await registry.begin_close(request_id=new_request_id(), session_key=key)
        await registry.release(request_id=new_request_id(), session_key="closed")
        now[0] += 5.0
        assert (await registry.sweep(request_id=new_request_id(), name_ttl=3600.0)).expired_leases
        answers = {
            "never-bound": ReleaseResult("never-bound", None, released_now=True),
            "bound": ReleaseResult("bound", "A", released_now=True),
            "closing": ReleaseResult("closing", "A", released_now=True),
            "closed": ReleaseResult("closed", "A", released_now=False),
            "expired": ReleaseResult("expired", "A", released_now=False),
        }
        for key, answer in answers.items():
            assert registry.close_session_now(key) == answer
            assert registry.core.session(key) is None
        assert registry.peek_version("A").session_refs == 0  # type: ignore[union-attr]
        assert (await registry.status()).live_sessions == 0
    finally:
        await registry.aclose()


async def test_a_closed_session_and_its_binder_are_freed_without_the_garbage_collector() -> None:
    # The binder's on_bound callback is the Session's own method: kept after the bind, it would
    # make a reference cycle that only a collector pass frees (every Session of a rollout).
    async with harness(published="A") as h, direct(h) as versioning:
        s = versioning.open_session("freed")
        await s.generate(BODY)
        await s.generate(BODY)
        assert run_without_suspending(s.close()) is not None
        session_ref, binder_ref = weakref.ref(s), weakref.ref(s._binder)
        gc.disable()
        try:
            del s
            assert session_ref() is None
            assert binder_ref() is None
        finally:
            gc.enable()


async def test_a_session_makes_no_drain_event_until_a_close_waits_for_a_request() -> None:
    async with harness(published="A") as h, direct(h) as versioning:
        s = versioning.open_session("events")
        await s.generate(BODY)
        assert (s._drained, s._close_waits) == (None, None)
        # Asked for before any close: the same event the close then sets.
        waits = s.close_waits
        assert waits is s.close_waits
        assert not waits.is_set()
        run_without_suspending(s.close())
        assert s._drained is None
        assert not waits.is_set()
