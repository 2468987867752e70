"""Owner leases on the client side: :class:`LeaseKeeper` with the real LocalRegistry, the real
Versioning and middleware, and respx engines at the HTTP edge.

Time is stepped, never waited for: the registry reads an injected wall clock, the keeper an
injected monotonic clock (both driven by one :class:`FakeTime`, at different offsets, so no
timestamp can leak from one to the other), and the keeper sleeps on that fake time. A killed
process is a keeper whose sleep never returns and whose objects are dropped, never closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from agentic_lora_http import HttpPushBackend
from tenacity import wait_fixed
from tenacity import wait_none

from agentic_lora.adapters.snapshot import AdapterSnapshot
from agentic_lora.assembly.deployment import Deployment
from agentic_lora.engines.transport import EngineTransport
from agentic_lora.errors import ConfigurationError
from agentic_lora.errors import RequestRefusedError
from agentic_lora.errors import SessionExpiredError
from agentic_lora.errors import SessionStillBoundError
from agentic_lora.leases import DEFAULT_LEASE_TTL
from agentic_lora.leases import LeaseEvent
from agentic_lora.leases import LeaseEventKind
from agentic_lora.leases import LeaseKeeper
from agentic_lora.leases import LeaseState
from agentic_lora.leases import default_owner
from agentic_lora.publication.publisher import PublicationOutcome
from agentic_lora.publication.publisher import Publisher
from agentic_lora.publication.publisher import RegistryRetry
from agentic_lora.publication.reclaimer import Reclaimer
from agentic_lora.registry.local import LocalRegistry
from agentic_lora.registry.types import LeaseStatus
from agentic_lora.registry.types import VersionState
from agentic_lora.registry.types import new_request_id
from agentic_lora.session import Session
from agentic_lora.session import SessionPhase
from agentic_lora.session import Versioning
from agentic_lora.testing.adapters import tiny_snapshot
from agentic_lora.testing.fleet import ScriptedFleet
from agentic_lora.testing.sglang_engine import EngineOp
from tests.session_support import ENGINES
from tests.session_support import Harness
from tests.session_support import harness
from tests.session_support import make_transport
from tests.session_support import publish

pytestmark = pytest.mark.asyncio

TTL = 60.0
RENEW = TTL / 3
WALL = 1_700_000_000.0  # the registry host's wall clock; the keeper's monotonic clock is far off


class FakeTime:
    """Seconds that move only when the test says so; a sleep ends once time reaches its end.

    A sleep's end is fixed when ``sleep`` is *called* (it returns a future), so whether the
    sleeping task has run yet cannot change when it wakes. :meth:`sleeping` waits until a sleep is
    pending, so a test steps time only once the keeper is actually waiting on it.
    """

    def __init__(self, start: float = 100.0) -> None:
        self.now = start
        self._sleepers: list[tuple[float, asyncio.Future[None]]] = []
        self._registered = asyncio.Event()

    def __call__(self) -> float:
        return self.now

    def sleep(self, delay: float) -> asyncio.Future[None]:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if delay <= 0:
            fut.set_result(None)
            return fut
        entry = (self.now + delay, fut)
        self._sleepers.append(entry)
        fut.add_done_callback(lambda _: self._sleepers.remove(entry))
        self._registered.set()
        return fut

    async def sleeping(self, count: int = 1) -> None:
        """Return once ``count`` sleeps are pending."""
        async with asyncio.timeout(30):  # a hang guard only
            while len(self._sleepers) < count:
                self._registered.clear()
                await self._registered.wait()

    def advance(self, seconds: float) -> None:
        self.now += seconds
        for due, fut in list(self._sleepers):
            if due <= self.now and not fut.done():
                fut.set_result(None)


@pytest.fixture
def t() -> FakeTime:
    """The test's one fake time: the keeper's clock and sleeps, and the registry's at an offset."""
    return FakeTime()


class RegistryClock:
    """The registry host's wall clock: the same fake time at another offset, plus a step."""

    def __init__(self, t: FakeTime) -> None:
        self.t = t
        self.step = 0.0

    def __call__(self) -> float:
        return WALL + self.t.now + self.step


def never(delay: float) -> asyncio.Future[None]:
    """The sleep of a killed process: its renewer never runs again."""
    return asyncio.get_running_loop().create_future()


class Events:
    """A keeper's lease events, awaitable by kind and count (no polling, no wall clock)."""

    def __init__(self, keeper: LeaseKeeper) -> None:
        self.events: list[LeaseEvent] = []
        self._changed = asyncio.Event()
        keeper.listeners.append(self._on)

    def _on(self, event: LeaseEvent) -> None:
        self.events.append(event)
        self._changed.set()

    def of(self, kind: LeaseEventKind) -> list[LeaseEvent]:
        return [e for e in self.events if e.kind is kind]

    async def wait(self, kind: LeaseEventKind, count: int = 1) -> LeaseEvent:
        async with asyncio.timeout(30):  # a hang guard only: every step here is event-driven
            while len(self.of(kind)) < count:
                self._changed.clear()
                await self._changed.wait()
        return self.of(kind)[count - 1]


def turn(tag: str, n: int = 1) -> dict[str, object]:
    return {"text": f"{tag} turn {n}", "sampling_params": {"max_new_tokens": 4}}


def sent(h: Harness, tag: str) -> int:
    return len([g for g in h.engines.generations() if str(g.body["text"]).startswith(tag + " ")])


async def bound_session(v: Versioning, name: str) -> Session:
    """Session ``name`` after its first turn: bound, under the owner's lease."""
    session = v.open_session(name)
    await session.generate(turn(name))
    return session


def lease_status(registry: LocalRegistry, lease_id: str) -> LeaseStatus | None:
    return registry.core.lease(lease_id)


@dataclass(kw_only=True)
class Leased(Harness):
    """A :class:`Harness` whose Versioning binds under a lease (both are always there)."""

    lease: LeaseKeeper
    wall: RegistryClock  # the registry host's clock: a test can step it apart from the keeper's


@contextlib.asynccontextmanager
async def leased(
    t: FakeTime, *, published: str | None = None, **lease: Any
) -> AsyncIterator[Leased]:
    """A harness whose Versioning binds under owner ``w0``'s lease, on fake time (with
    ``published`` already published, when given)."""
    options: dict[str, Any] = {
        "owner": "w0",
        "ttl": TTL,
        "clock": t,
        "sleep": t.sleep,
        "registry_retry": RegistryRetry(attempts=4, wait=wait_fixed(5)),
    }
    options.update(lease)
    wall = RegistryClock(t)
    async with harness(
        registry_options={"clock": wall, "sweep_interval": None},
        lease=options,
        published=published,
    ) as h:
        assert h.lease is not None
        fields = {f.name: getattr(h, f.name) for f in dataclasses.fields(h)}
        yield Leased(**fields, wall=wall)


@pytest_asyncio.fixture
async def h(t: FakeTime) -> AsyncIterator[Leased]:
    """The common start: :func:`leased` on the defaults, with A published."""
    async with leased(t, published="A") as h:
        yield h


async def refused_as_expired(session: Session, n: int = 2) -> SessionExpiredError:
    """The Session's turn ``n`` is refused as expired (a refusal: nothing is sent)."""
    with pytest.raises(SessionExpiredError) as err:
        await session.generate(turn(session.session_id, n))
    return err.value


async def partition(h: Leased, t: FakeTime) -> None:
    """Cut the keeper off from the registry at its next renewal; return once that renewal has
    failed and its retry waits on fake time (``fail_before["renew_lease"] = 0`` heals it)."""
    h.registry.fail_before["renew_lease"] = 10**6
    await t.sleeping()
    t.advance(RENEW)
    await h.registry.called("renew_lease")
    await t.sleeping()


# --- a dead owner ----------------------------------------------------------------------------


async def test_a_killed_owner_loses_its_refs_after_the_ttl_and_a_late_dispatch_sends_nothing(
    t: FakeTime,
) -> None:
    async with leased(t, sleep=never, published="A") as h:
        reg, v = h.registry, h.versioning
        s1, s2 = await bound_session(v, "s1"), await bound_session(v, "s2")
        await publish(reg, "B")
        assert h.refs("A") == 2
        # Killed: its renewer never runs again, nothing is closed.
        t.advance(TTL - 1)
        assert await h.inner.sweep_if_due() is None
        with pytest.raises(SessionStillBoundError):
            await reg.claim_reclaim(request_id=new_request_id(), version_id="A")
        t.advance(1)
        swept = await h.inner.sweep_if_due()
        assert swept is not None
        assert swept.expired_leases == (h.lease.current.lease_id,)
        assert sorted(swept.expired_sessions) == sorted([s1.key, s2.key])
        assert h.refs("A") == 0
        claim = await reg.claim_reclaim(request_id=new_request_id(), version_id="A")
        assert claim.version_id == "A"
        assert h.inner.state_of("A") is VersionState.RECLAIMING

        # A late dispatch on the expired Session: typed refusal, nothing reaches an engine, and
        # nothing reaches the registry either (the local check comes first).
        before = sent(h, "s1"), reg.calls["bind_first"]
        with pytest.raises(SessionExpiredError) as err:
            await s1.generate(turn("s1", 2))
        assert err.value.code == "SESSION_EXPIRED"
        assert err.value.details["lease"] == h.lease.current.lease_id
        assert (sent(h, "s1"), reg.calls["bind_first"]) == before

        # Close after expiry works: nothing left to release, and the local record is freed.
        result = await s1.close()
        assert result is not None
        assert result.version_id == "A"
        assert result.released_now is False
        assert s1.phase is SessionPhase.CLOSED
        assert v.get("s1") is None
        assert h.inner.core.session(s1.key) is None  # the tombstone was forgotten too


async def test_the_local_deadline_refuses_dispatch_before_the_registry_sweeps(
    t: FakeTime, h: Leased
) -> None:
    v = h.versioning
    s = await bound_session(v, "s")
    await partition(h, t)
    await s.generate(turn("s", 2))  # still inside its lease: dispatch does not wait
    t.advance(TTL - RENEW)  # exactly the local deadline
    assert (await refused_as_expired(s, 3)).details["reason"] == "local_deadline"
    assert sent(h, "s") == 2
    # The registry has not swept: for it the lease and the ref still exist.
    assert lease_status(h.inner, h.lease.current.lease_id) is not None
    assert h.refs("A") == 1
    swept = await h.inner.sweep_if_due()
    assert swept is not None
    assert swept.expired_sessions == (s.key,)


async def test_a_lease_the_registry_ended_refuses_its_sessions_and_new_ones_get_a_new_incarnation(
    h: Leased,
) -> None:
    reg, v = h.registry, h.versioning
    bound = await bound_session(v, "bound")
    first = h.lease.current
    h.wall.step = TTL  # the registry host's clock leaps ahead: it expires the lease early
    assert (await h.inner.sweep_if_due()) is not None
    assert first.state is LeaseState.HELD  # our own deadline has not passed

    # An unbound Session binds under it: the registry answers LEASE_EXPIRED, nothing was
    # bound, and the caller gets SESSION_EXPIRED with nothing sent.
    late = v.open_session("late")
    assert (await refused_as_expired(late, 1)).details["reason"] == "expired"
    assert late.lease is first
    assert first.state is LeaseState.LOST
    await refused_as_expired(bound)
    with pytest.raises(SessionExpiredError):  # pinned to the lost lease for good
        await late.generate(turn("late", 2))
    assert sent(h, "late") == 0
    assert sent(h, "bound") == 1

    # A new Session works, under a fresh incarnation of the same owner.
    fresh = await bound_session(v, "fresh")
    assert fresh.lease is h.lease.current
    assert fresh.lease is not first
    assert fresh.lease.lease_id.startswith("w0/")
    assert [lease.lease_id for lease in h.inner.core.status().leases] == [fresh.lease.lease_id]
    assert reg.calls["renew_lease"] == 0  # the registry said so at the bind; no probe needed
    result = await late.close()
    assert result is not None
    assert result.version_id is None  # it never bound


# --- restarts --------------------------------------------------------------------------------


async def test_a_restarted_owner_releases_its_predecessors_sessions_at_once(t: FakeTime) -> None:
    async with leased(t, sleep=never, published="A") as h:
        reg, v = h.registry, h.versioning
        s1, s2 = await bound_session(v, "s1"), await bound_session(v, "s2")
        await publish(reg, "B")
        successor = LeaseKeeper(h.inner, owner="w0", ttl=TTL, clock=t, sleep=t.sleep)
        log = Events(successor)
        term = await successor.acquire()  # no time passes
        assert h.refs("A") == 0
        opened = log.of(LeaseEventKind.OPENED)[0]
        assert sorted(opened.released) == sorted([s1.key, s2.key])
        assert term.incarnation != h.lease.current.incarnation
        assert (await reg.claim_reclaim(request_id=new_request_id(), version_id="A")).reclaim_id
        await successor.aclose()


async def test_a_superseded_zombie_refuses_old_and_new_sessions_and_never_takes_the_lease_back(
    t: FakeTime, h: Leased
) -> None:
    reg, v = h.registry, h.versioning
    s = await bound_session(v, "s")
    successor = LeaseKeeper(h.inner, owner="w0", ttl=TTL, clock=t, sleep=never)
    await successor.acquire()
    survivor = await h.inner.bind_first(
        request_id=new_request_id(), session_key="survivor", lease=successor.current.lease_id
    )
    # The old process was only hung; its next renewal learns it was superseded.
    log = Events(h.lease)
    await t.sleeping()
    t.advance(RENEW)
    lost = await log.wait(LeaseEventKind.LOST)
    assert lost.reason == "owner_restarted"
    await refused_as_expired(s)
    newcomer = v.open_session("newcomer")
    assert (await refused_as_expired(newcomer, 1)).details["reason"] == "owner_restarted"
    assert h.lease.superseded
    assert reg.calls["open_lease"] == 1  # it never reopened: that would end the successor's
    assert successor.current.state is LeaseState.HELD
    assert lease_status(h.inner, successor.current.lease_id) is not None
    assert h.refs(survivor.version_id) == 1
    assert sent(h, "s") == 1
    assert sent(h, "newcomer") == 0
    await successor.aclose()


async def test_after_a_partition_the_keeper_asks_before_it_reopens(t: FakeTime, h: Leased) -> None:
    reg, v = h.registry, h.versioning
    s = await bound_session(v, "s")
    first = h.lease.current
    await partition(h, t)
    t.advance(TTL)
    assert first.state is LeaseState.LOST  # lost on our side; the registry still holds it
    assert first.lost_reason == "local_deadline"
    assert lease_status(h.inner, first.lease_id) is not None

    # The partition heals; no other process took the slot: the probe finds the lease still
    # live, so the keeper opens a new incarnation, which ends the old lease at once.
    reg.fail_before["renew_lease"] = 0
    fresh = await bound_session(v, "fresh")
    assert fresh.lease is not None
    assert fresh.lease is not first
    assert lease_status(h.inner, first.lease_id) is None
    assert h.refs("A") == 1  # only the fresh Session's; the old one's ref was released
    await refused_as_expired(s)


async def test_after_a_partition_a_superseded_keeper_does_not_reopen(
    t: FakeTime, h: Leased
) -> None:
    reg, v = h.registry, h.versioning
    await v.open_session("s").generate(turn("s"))
    await partition(h, t)
    t.advance(TTL)
    assert h.lease.current.state is LeaseState.LOST
    # Meanwhile the orchestrator restarted the worker slot elsewhere.
    successor = LeaseKeeper(h.inner, owner="w0", ttl=TTL, clock=t, sleep=never)
    await successor.acquire()
    reg.fail_before["renew_lease"] = 0
    with pytest.raises(SessionExpiredError) as err:
        await v.open_session("newcomer").generate(turn("newcomer"))
    assert err.value.details["reason"] == "owner_restarted"
    assert h.lease.superseded
    assert reg.calls["open_lease"] == 1
    assert successor.current.state is LeaseState.HELD
    await successor.aclose()


# --- renewal ---------------------------------------------------------------------------------


async def test_renewals_keep_a_busy_session_alive_across_many_ttls(t: FakeTime, h: Leased) -> None:
    reg, v = h.registry, h.versioning
    s = await bound_session(v, "s")
    log = Events(h.lease)
    start = t.now
    for n in range(1, 31):
        await t.sleeping()
        t.advance(RENEW)
        await log.wait(LeaseEventKind.RENEWED, n)
        await s.generate(turn("s", n + 1))
        assert await h.inner.sweep_if_due() is None
    assert t.now - start == 10 * TTL
    assert h.refs("A") == 1
    assert sent(h, "s") == 31
    assert h.lease.current.state is LeaseState.HELD
    ids = reg.request_ids("renew_lease")
    assert len(ids) == len(set(ids)) == 30  # one round each, no replays needed
    status = lease_status(h.inner, h.lease.current.lease_id)
    assert status is not None
    assert status.expires_at == h.wall() + TTL


async def test_an_idle_owner_renews_in_the_background(t: FakeTime) -> None:
    async with leased(t) as h:
        await publish(h.registry, "A")
        await h.versioning.open_session("idle").generate(turn("idle"))
        log = Events(h.lease)
        for n in range(1, 7):  # two TTLs without a single dispatch
            await t.sleeping()
            t.advance(RENEW)
            await log.wait(LeaseEventKind.RENEWED, n)
            assert await h.inner.sweep_if_due() is None
        assert h.refs("A") == 1


async def test_a_dispatch_wakes_an_overdue_renewal_and_does_not_wait_for_it(t: FakeTime) -> None:
    async with leased(
        t, sleep=never, published="A"
    ) as h:  # the timer never fires: only dispatches renew
        reg, v = h.registry, h.versioning
        s = await bound_session(v, "s")
        log = Events(h.lease)
        t.advance(RENEW - 1)
        await s.generate(turn("s", 2))
        assert reg.calls["renew_lease"] == 0  # not overdue yet
        t.advance(1)
        gate = reg.gate("renew_lease")
        reply = await s.generate(turn("s", 3))  # returns while the renewal it woke is held
        assert reply.status_code == 200
        await reg.entered["renew_lease"].wait()
        assert not log.of(LeaseEventKind.RENEWED)
        gate.set()
        await log.wait(LeaseEventKind.RENEWED)
        assert reg.calls["renew_lease"] == 1
        assert reg.calls["bind_first"] == 1


async def test_lost_open_and_renew_replies_are_replayed_with_the_same_request_id(
    t: FakeTime,
) -> None:
    async with leased(t, registry_retry=RegistryRetry(attempts=4, wait=wait_none())) as h:
        reg, v = h.registry, h.versioning
        reg.lose_reply["open_lease"] = 1
        reg.lose_reply["renew_lease"] = 2
        await publish(reg, "A")
        await v.open_session("s").generate(turn("s"))
        opens = reg.request_ids("open_lease")
        assert len(opens) == 2
        assert len(set(opens)) == 1
        log = Events(h.lease)
        await t.sleeping()
        t.advance(RENEW)
        await log.wait(LeaseEventKind.RENEWED)
        renews = reg.request_ids("renew_lease")
        assert len(renews) == 3
        assert len(set(renews)) == 1
        status = lease_status(h.inner, h.lease.current.lease_id)
        assert status is not None
        assert status.expires_at == h.wall() + TTL


async def test_the_local_deadline_counts_from_the_send_so_it_is_never_after_the_registrys(
    t: FakeTime, h: Leased
) -> None:
    reg, v = h.registry, h.versioning
    await v.open_session("s").generate(turn("s"))
    log = Events(h.lease)
    gate = reg.gate("renew_lease")
    await t.sleeping()
    t.advance(RENEW)
    sent_at = t.now
    await reg.entered["renew_lease"].wait()
    t.advance(7)  # the renewal takes 7 s to reach the registry
    gate.set()
    await log.wait(LeaseEventKind.RENEWED)
    term = h.lease.current
    assert term.renewed_at == sent_at
    assert term.deadline == sent_at + TTL
    status = lease_status(h.inner, term.lease_id)
    assert status is not None
    assert status.expires_at == WALL + sent_at + 7 + TTL
    # Read in one timebase (both clocks are the same fake time at different offsets):
    assert WALL + term.deadline <= status.expires_at


async def test_a_failed_renewal_is_replayed_with_one_request_id_until_the_local_deadline(
    t: FakeTime, h: Leased
) -> None:
    # The keeper retries every 5 s of fake time (the leased default).
    reg, v = h.registry, h.versioning
    s = await bound_session(v, "s")
    term = h.lease.current
    assert term.deadline == t.now + TTL
    log = Events(h.lease)
    reg.fail_before["renew_lease"] = 10**6
    await t.sleeping()
    t.advance(RENEW)
    for n in range(1, 8):  # tries at +20, +25, ..., +50 s
        await reg.called("renew_lease", n)
        await t.sleeping()
        await s.generate(turn("s", n))  # dispatch goes on while the renewal retries
        t.advance(5)
    await reg.called("renew_lease", 8)  # the try at +55 s: the next could only land after +60
    lost = await log.wait(LeaseEventKind.LOST)
    assert lost.reason == "renew_failed"
    assert t.now < term.deadline  # given up just before the deadline, not after
    assert len(set(reg.request_ids("renew_lease"))) == 1
    assert (await refused_as_expired(s, 9)).details["reason"] == "renew_failed"
    assert repr(term) == f"LeaseTerm({term.lease_id!r}, LOST)"


async def test_a_renewal_answered_after_the_old_deadline_does_not_revive_the_lease(
    t: FakeTime, h: Leased
) -> None:
    reg, v = h.registry, h.versioning
    s = await bound_session(v, "s")
    log = Events(h.lease)
    gate = reg.gate("renew_lease")
    await t.sleeping()
    t.advance(RENEW)
    await reg.entered["renew_lease"].wait()
    t.advance(TTL - RENEW)  # the old deadline passes while the renewal is in flight
    gate.set()
    lost = await log.wait(LeaseEventKind.LOST)
    assert lost.reason == "local_deadline"
    assert not log.of(LeaseEventKind.RENEWED)
    await refused_as_expired(s)


async def test_an_open_granted_after_its_own_deadline_does_not_count(
    t: FakeTime, h: Leased
) -> None:
    reg, v = h.registry, h.versioning
    first = h.lease.current
    gate = reg.gate("open_lease")
    s = v.open_session("s")
    pending = asyncio.create_task(s.generate(turn("s")))
    await reg.entered["open_lease"].wait()
    t.advance(TTL)  # the open takes a whole TTL to come back
    gate.set()
    await pending  # the bind goes on under a fresh incarnation
    assert first.state is LeaseState.LOST
    assert s.lease is h.lease.current
    assert s.lease is not first
    assert reg.calls["open_lease"] == 2
    assert reg.calls["renew_lease"] == 1  # the probe: was the first one superseded? no
    assert lease_status(h.inner, first.lease_id) is None  # ended by the new incarnation
    assert h.refs("A") == 1


async def test_an_open_whose_lease_died_meanwhile_moves_to_a_new_incarnation(t: FakeTime) -> None:
    async with leased(
        t, registry_retry=RegistryRetry(attempts=2, wait=wait_none()), published="A"
    ) as h:
        reg, v = h.registry, h.versioning
        first = h.lease.current
        reg.lose_reply["open_lease"] = 2  # applied twice over, answered never
        s = v.open_session("s")
        with pytest.raises(RequestRefusedError):
            await s.generate(turn("s"))
        assert lease_status(h.inner, first.lease_id) is not None  # it exists, unknown to us
        h.wall.step = TTL
        assert (await h.inner.sweep_if_due()) is not None  # and expires there
        await s.generate(turn("s", 2))  # its open is refused: LEASE_EXPIRED -> next incarnation
        assert first.state is LeaseState.LOST
        assert first.lost_reason == "expired"
        assert s.lease is h.lease.current
        assert s.lease is not first
        assert sent(h, "s") == 1


# --- opening and closing ---------------------------------------------------------------------


async def test_the_lease_opens_lazily_once_for_concurrent_first_binds(t: FakeTime) -> None:
    async with leased(t) as h:
        reg, v = h.registry, h.versioning
        assert h.lease.current.state is LeaseState.PENDING
        assert not {"open_lease", "renew_lease"} & set(reg.calls)  # no I/O at construction
        await publish(reg, "A")
        gate = reg.gate("open_lease")
        sessions = [v.open_session(f"c{i}") for i in range(10)]
        tasks = [asyncio.create_task(s.generate(turn(f"c{i}"))) for i, s in enumerate(sessions)]
        await reg.entered["open_lease"].wait()
        tasks[0].cancel()  # a cancelled first bind leaves the shared open running
        gate.set()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert isinstance(results[0], asyncio.CancelledError)
        assert reg.calls["open_lease"] == 1
        assert {s.lease for s in sessions[1:]} == {h.lease.current}
        status = lease_status(h.inner, h.lease.current.lease_id)
        assert status is not None
        assert status.sessions == 10  # the cancelled waiter's Session bound too (shared bind)


async def test_an_unconfirmed_open_refuses_the_bind_with_nothing_sent_and_the_next_one_works(
    t: FakeTime,
) -> None:
    async with leased(
        t, registry_retry=RegistryRetry(attempts=2, wait=wait_none()), published="A"
    ) as h:
        reg, v = h.registry, h.versioning
        reg.fail_before["open_lease"] = 2
        s = v.open_session("s")
        with pytest.raises(RequestRefusedError) as err:
            await s.generate(turn("s"))
        assert err.value.details["stage"] == "lease"
        assert s.lease is None
        assert s.phase is SessionPhase.OPEN
        assert reg.calls["bind_first"] == 0
        assert sent(h, "s") == 0
        await s.generate(turn("s", 2))
        assert s.lease is not None
        assert s.lease.state is LeaseState.HELD


async def test_aclose_releases_sessions_then_closes_the_lease_and_stops_renewing(
    t: FakeTime, h: Leased
) -> None:
    reg, v = h.registry, h.versioning
    await v.open_session("a").generate(turn("a"))
    v.open_session("b")  # never dispatched
    lease_id = h.lease.current.lease_id
    log = Events(h.lease)
    await v.aclose()
    verbs = [verb for _, verb, _ in reg.log]
    releases = [i for i, verb in enumerate(verbs) if verb == "release"]
    assert len(releases) == 2
    assert verbs.index("close_lease") > max(releases)
    closed = log.of(LeaseEventKind.CLOSED)[0]
    assert closed.released == ()  # a clean shutdown leaves nothing for the lease to release
    assert lease_status(h.inner, lease_id) is None
    assert h.refs("A") == 0
    assert h.lease.current.state is LeaseState.CLOSED
    t.advance(10 * TTL)  # nothing renews any more
    await v.aclose()  # idempotent
    assert reg.calls["close_lease"] == 1
    assert reg.calls["renew_lease"] == 0
    with pytest.raises(SessionExpiredError) as err:
        await v.open_session("late").generate(turn("late"))
    assert err.value.details["reason"] == "closed"
    with pytest.raises(SessionExpiredError):
        h.lease.check()


async def test_a_keeper_closed_with_sessions_on_its_lease_expires_them(h: Leased) -> None:
    v = h.versioning
    s = await bound_session(v, "s")
    log = Events(h.lease)
    await h.lease.aclose()
    assert log.of(LeaseEventKind.CLOSED)[0].released == (s.key,)
    assert h.refs("A") == 0
    await refused_as_expired(s)
    result = await s.close()
    assert result is not None
    assert result.released_now is False


async def test_an_unconfirmed_close_lease_is_logged_and_left_to_the_ttl(
    caplog: pytest.LogCaptureFixture,
    t: FakeTime,
) -> None:
    async with leased(t, registry_retry=RegistryRetry(attempts=2, wait=wait_none())) as h:
        reg = h.registry
        await publish(reg, "A")
        await h.lease.acquire()
        reg.fail_before["close_lease"] = 2
        with caplog.at_level(logging.WARNING, logger="agentic_lora.leases"):
            await h.lease.aclose()
        # Told once, by the keeper, naming the lease the TTL will end.
        [warned] = [r for r in caplog.records if r.name == "agentic_lora.leases.keeper"]
        assert (warned.levelno, warned.lease) == (logging.WARNING, h.lease.current.lease_id)  # type: ignore[attr-defined]
        assert lease_status(h.inner, h.lease.current.lease_id) is not None  # the TTL will end it
        assert h.lease.current.state is LeaseState.CLOSED


async def test_a_failing_listener_is_logged_and_does_not_break_the_keeper(
    caplog: pytest.LogCaptureFixture,
    t: FakeTime,
) -> None:
    async with leased(t) as h:

        def broken(event: LeaseEvent) -> None:
            raise RuntimeError("listener bug")

        h.lease.listeners.append(broken)
        await publish(h.registry, "A")
        with caplog.at_level(logging.ERROR, logger="agentic_lora.leases"):
            await h.versioning.open_session("s").generate(turn("s"))
        failed = [r for r in caplog.records if r.exc_info is not None]
        assert [r.exc_info[0] for r in failed] == [RuntimeError]  # type: ignore[index]
        assert failed[0].lease == h.lease.current.lease_id  # type: ignore[attr-defined]
        assert h.lease.current.state is LeaseState.HELD


# --- construction ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "check"),
    [
        ({"ttl": 0}, "lease"),
        ({"ttl": float("inf")}, "lease"),
        ({"ttl": True}, "lease"),
        ({"ttl": 60, "renew_interval": 60}, "lease"),
        ({"ttl": 60, "renew_interval": 0}, "lease"),
        ({"owner": "rollout worker 3"}, "owner_id"),
        ({"owner": ""}, "owner_id"),
        ({"owner": "w" * 201}, "owner_id"),
        ({"on_restart": "forget"}, "on_restart"),
    ],
)
async def test_bad_keeper_options_fail_fast_with_their_check(
    options: dict[str, Any], check: str
) -> None:
    with pytest.raises(ConfigurationError) as err:
        LeaseKeeper(object(), **options)  # type: ignore[arg-type]
    assert err.value.details["check"] == check


async def test_defaults_minutes_ttl_a_third_renew_interval_and_a_hostname_pid_owner() -> None:
    keeper = LeaseKeeper(object())  # type: ignore[arg-type]
    assert keeper.ttl == DEFAULT_LEASE_TTL == 60.0
    assert keeper.renew_interval == 20.0
    assert keeper.owner == default_owner()
    assert not keeper.owner_configured
    assert keeper.on_restart == "release"
    assert keeper.current.lease_id == f"{keeper.owner}/{keeper.current.incarnation}"
    assert len(keeper.current.incarnation) == 32
    assert keeper.current.state is LeaseState.PENDING
    keeper.check()  # nothing bound under a pending lease: nothing to refuse
    keeper.touch()
    assert repr(keeper).startswith("LeaseKeeper(")
    named = LeaseKeeper(object(), owner="rollout-worker-3", on_restart="adopt")  # type: ignore[arg-type]
    assert named.owner_configured
    assert named.on_restart == "adopt"
    assert LeaseKeeper(object()).current.incarnation != keeper.current.incarnation  # type: ignore[arg-type]


async def test_a_versioning_needs_the_flag_on_for_a_lease() -> None:
    transport = make_transport()
    registry = LocalRegistry(engines=tuple(ENGINES), capacity=2)
    try:
        with pytest.raises(ConfigurationError) as err:
            Versioning(transport=transport, enabled=False, lease=LeaseKeeper(registry))
        assert err.value.details["check"] == "lease"
        assert Versioning(transport=transport, registry=registry).lease is None
    finally:
        await transport.aclose()
        await registry.aclose()


# --- the motivating bug, end to end on a journal ----------------------------------------------

A, B, C = tiny_snapshot(1), tiny_snapshot(2), tiny_snapshot(3)
FAST = RegistryRetry(attempts=3, wait=wait_none())


@dataclass
class Process:
    """One process's registry (on the shared journal), publisher, reclaimer and Sessions."""

    registry: LocalRegistry
    backend: HttpPushBackend
    publisher: Publisher
    reclaimer: Reclaimer
    transport: EngineTransport
    keeper: LeaseKeeper
    versioning: Versioning

    async def publish(self, version_id: str, snapshot: AdapterSnapshot) -> PublicationOutcome:
        return (await self.publisher.publish(version_id, snapshot)).outcome

    def kill(self) -> None:
        """What SIGKILL leaves: no close, no release; the OS drops the journal's lock."""
        assert self.registry._journal is not None
        self.registry._journal.close()

    async def bury(self) -> None:
        """Free a killed process's in-memory leftovers (tasks, threads) without any registry call."""
        for task in (self.keeper._renewer, self.registry._writer):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self.registry._executor is not None:
            self.registry._executor.shutdown(wait=True)
        await self.transport.aclose()
        await self.backend.aclose()

    async def shutdown(self) -> None:
        await self.versioning.aclose()
        await self.reclaimer.stop()
        await self.transport.aclose()
        await self.backend.aclose()
        await self.registry.aclose()


def start_process(
    journal: Path, store: Path, fleet: ScriptedFleet, t: FakeTime, *, sleep: Any = None
) -> Process:
    registry = LocalRegistry(
        engines=("e0", "e1"),
        capacity=2,
        journal_path=journal,
        clock=RegistryClock(t),
        sweep_interval=None,
    )
    backend = HttpPushBackend(store)
    reclaimer = Reclaimer(registry, backend, fleet.refs, registry_retry=FAST)
    publisher = Publisher(registry, backend, fleet.refs, reclaimer=reclaimer, registry_retry=FAST)
    transport = EngineTransport(fleet.refs, http_transport="httpx", control_wait=wait_none())
    keeper = LeaseKeeper(registry, owner="w0", ttl=TTL, clock=t, sleep=sleep or t.sleep)
    versioning = Versioning(transport=transport, registry=registry, lease=keeper)
    return Process(registry, backend, publisher, reclaimer, transport, keeper, versioning)


@contextlib.asynccontextmanager
async def after_a_killed_worker_holding_a(
    tmp_path: Path, t: FakeTime
) -> AsyncIterator[tuple[ScriptedFleet, Process]]:
    """Process 1 publishes A, binds two Sessions on it, and is killed without closing them;
    process 2 starts on the same journal and publishes B. Yields the fleet and process 2."""
    journal, store = tmp_path / "j.sqlite", tmp_path / "store"
    with ScriptedFleet(("e0", "e1")) as fleet:
        p1 = start_process(journal, store, fleet, t, sleep=never)
        try:
            assert await p1.publish("A", A) is PublicationOutcome.PUBLISHED
            for name in ("s1", "s2"):
                await p1.versioning.open_session(name).generate(turn(name))
            assert p1.registry.core.version("A").session_refs == 2
            p1.kill()
            p2 = start_process(journal, store, fleet, t)
            try:
                assert await p2.publish("B", B) is PublicationOutcome.PUBLISHED
                yield fleet, p2
            finally:
                await p2.shutdown()
        finally:
            await p1.bury()


def unloads(fleet: ScriptedFleet) -> int:
    return sum(e.count(EngineOp.UNLOAD) for e in fleet.engines.values())


async def test_a_killed_worker_blocks_c_only_until_its_lease_expires(
    tmp_path: Path, t: FakeTime
) -> None:
    async with after_a_killed_worker_holding_a(tmp_path, t) as (fleet, p2):
        a = p2.registry.core.version("A")
        assert (a.state, a.session_refs) == (VersionState.RETIRED, 2)
        assert await p2.publish("C", C) is PublicationOutcome.SKIPPED
        # The restarted registry gave the dead worker's lease a full TTL from its first call.
        t.advance(TTL - 1)
        assert await p2.registry.sweep_if_due() is None
        assert await p2.publish("C", C) is PublicationOutcome.SKIPPED
        assert unloads(fleet) == 0
        t.advance(1)
        swept = await p2.registry.sweep_if_due()
        assert swept is not None
        assert len(swept.expired_sessions) == 2
        assert await p2.publish("C", C) is PublicationOutcome.PUBLISHED
        assert p2.registry.core.version("A").state is VersionState.RECLAIMED
        assert unloads(fleet) == 2  # once per engine


async def test_a_restarted_worker_releases_the_dead_ones_sessions_at_once(
    tmp_path: Path, t: FakeTime
) -> None:
    async with after_a_killed_worker_holding_a(tmp_path, t) as (_, p2):
        assert await p2.publish("C", C) is PublicationOutcome.SKIPPED
        # Worker slot w0 comes back in this process: its first Session opens w0's lease,
        # which releases the dead incarnation's two Sessions. No time passes.
        async with p2.versioning.session("s3") as s3:
            await s3.generate(turn("s3"))
            assert s3.binding is not None
            assert s3.binding.version_id == "B"
            assert p2.registry.core.version("A").session_refs == 0
            assert await p2.publish("C", C) is PublicationOutcome.PUBLISHED
        assert p2.registry.core.version("A").state is VersionState.RECLAIMED


async def test_a_renewer_that_dies_says_so_and_the_deadline_still_refuses(t: FakeTime) -> None:

    def broken_sleep(delay: float) -> asyncio.Future[None]:
        raise RuntimeError("injected sleep failed")

    async with leased(t, sleep=broken_sleep) as h:
        await publish(h.registry, "A")
        s = h.versioning.open_session("s")
        await s.generate(turn("s"))
        renewer = h.lease._renewer
        assert renewer is not None
        await asyncio.wait({renewer})  # it ends with the injected failure, not by cancellation
        assert isinstance(renewer.exception(), RuntimeError)
        t.advance(TTL)
        await refused_as_expired(s)


async def test_a_deployment_reclaims_as_soon_as_a_lease_releases_a_dead_workers_sessions(
    tmp_path: Path,
    t: FakeTime,
) -> None:
    with ScriptedFleet(("e0", "e1")) as fleet:
        settings = fleet.settings(owner_id="w0")
        registry = LocalRegistry(
            engines=("e0", "e1"), capacity=2, clock=RegistryClock(t), sweep_interval=None
        )
        async with Deployment.from_settings(
            settings, registry=registry, backend_options={"store_root": str(tmp_path / "store")}
        ) as d:
            assert d.versioning.lease is not None
            assert d.versioning.lease.owner == "w0"
            await d.publish("A", A)
            await d.versioning.open_session("s").generate(turn("s"))  # never closed: "killed"
            await d.publish("B", B)
            await d.reclaimer.settled()
            assert registry.state_of("A") is VersionState.RETIRED
            # Slot w0 restarts: opening its lease releases the dead incarnation's Session, and
            # that alone wakes the background reclaimer (no release call, no publication).
            restarted = LeaseKeeper(registry, owner="w0", ttl=TTL, clock=t, sleep=never)
            await restarted.acquire()
            await d.reclaimer.settled()
            assert registry.state_of("A") is VersionState.RECLAIMED
            await restarted.aclose()
        await registry.aclose()
