"""A dead owner's leases expire whichever process reopens its journal, whether or not that process
ever opens a lease: expiry belongs to the registry host, not to one owner's lease keeper.

Deterministic tests step the registry host's clock and gate its sweeper's sleep (one sweep per
:meth:`SweepGate.round`); the last test kills a real worker process holding bound Sessions and
reopens its journal in this one (``tests/leases/dead_worker.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from agentic_lora.assembly.deployment import Deployment
from agentic_lora.errors import CapacityError
from agentic_lora.publication.result import PublicationOutcome
from agentic_lora.registry.local import LocalRegistry
from agentic_lora.registry.types import SweepResult
from agentic_lora.registry.types import VersionState
from agentic_lora.registry.types import new_request_id
from agentic_lora.testing.adapters import tiny_snapshot
from agentic_lora.testing.fleet import ScriptedFleet
from agentic_lora.testing.publish import digest_for
from agentic_lora.testing.publish import publish_by_verbs
from tests.leases.dead_worker import dead_worker_reopened
from tests.leases.dead_worker import problems_of
from tests.registry.util import FakeClock
from tests.registry.util import SweepGate

pytestmark = pytest.mark.asyncio

ENGINES = ("e0", "e1")
TTL = 60.0
INTERVAL = 1.0
DEAD = "worker-0/i1"
REOPENED_AT = 10_000.0  # the registry was down for far longer than the TTL


async def dead_worker_journal(journal: Path, clock: FakeClock) -> None:
    """What a killed worker leaves: A published, two Sessions bound on A under its lease, B
    published (A RETIRED and pinned: both slots held). Every row it acknowledged is on disk."""
    reg = LocalRegistry(
        engines=ENGINES, capacity=2, journal_path=journal, clock=clock, sweep_interval=None
    )
    await publish_by_verbs(reg, "A", ENGINES)
    grant = await reg.open_lease(
        request_id=new_request_id(), owner="worker-0", incarnation="i1", ttl=TTL
    )
    for key in ("s1", "s2"):
        await reg.bind_first(request_id=new_request_id(), session_key=key, lease=grant.lease_id)
    await publish_by_verbs(reg, "B", ENGINES)
    await reg.aclose()  # no close_lease, no release: as a kill -9 leaves it


def reopen(journal: Path, clock: FakeClock, gate: SweepGate) -> LocalRegistry:
    clock.t = REOPENED_AT
    return LocalRegistry(
        engines=ENGINES,
        capacity=2,
        journal_path=journal,
        clock=clock,
        sweep_interval=INTERVAL,
        sleep=gate.sleep,
    )


async def test_a_reopened_registry_that_only_starts_expires_the_dead_workers_lease(
    tmp_path: Path,
) -> None:
    journal, clock, gate = tmp_path / "j.sqlite", FakeClock(0.0), SweepGate()
    await dead_worker_journal(journal, clock)
    reg = reopen(journal, clock, gate)
    try:
        assert not reg.sweeping  # nothing runs before the host takes up its duties
        await reg.start()  # what Deployment.start does; this process never opens a lease
        assert reg.sweeping
        await gate.asleep()
        assert gate.delays == [INTERVAL]
        lease = reg.core.lease(DEAD)
        assert lease is not None
        # The registry was down: the dead owner's lease got a full TTL from the reopen.
        assert lease.expires_at == REOPENED_AT + TTL
        clock.t = REOPENED_AT + TTL - 0.5
        await gate.round()
        assert reg.core.version("A").session_refs == 2
        clock.t = REOPENED_AT + TTL
        await gate.round()
        a = reg.core.version("A")
        assert (a.state, a.session_refs) == (VersionState.RETIRED, 0)
        assert reg.core.lease(DEAD) is None
        assert reg.core.status().leases == ()
    finally:
        await reg.aclose()
    assert not reg.sweeping


async def test_a_reopened_registry_whose_process_only_publishes_sweeps_too(tmp_path: Path) -> None:
    journal, clock, gate = tmp_path / "j.sqlite", FakeClock(0.0), SweepGate()
    await dead_worker_journal(journal, clock)
    reg = reopen(journal, clock, gate)
    seen: list[SweepResult] = []
    reg.add_listener(lambda verb, result: seen.append(result) if verb == "sweep" else None)
    try:
        # No start(), no lease: the first call (a publication refused for capacity) resumes
        # the replayed leases, and from then on the registry sweeps them.
        with pytest.raises(CapacityError):
            await reg.reserve(request_id=new_request_id(), version_id="C", digest=digest_for("C"))
        assert reg.sweeping
        clock.t = REOPENED_AT + TTL
        await gate.round()
        assert seen == [SweepResult((DEAD,), ("s1", "s2"), 0)]
        assert reg.core.version("A").session_refs == 0
        claim = await reg.claim_reclaim(request_id=new_request_id(), version_id="A")
        for engine in ENGINES:
            await reg.confirm_reclaim(
                request_id=new_request_id(),
                version_id="A",
                reclaim_id=claim.reclaim_id,
                engine=engine,
            )
        await publish_by_verbs(reg, "C", ENGINES)
        assert reg.core.default_version == "C"
    finally:
        await reg.aclose()


async def test_a_registry_without_leases_or_names_does_not_sweep_until_started(
    tmp_path: Path,
) -> None:
    clock, gate = FakeClock(0.0), SweepGate()
    reg = LocalRegistry(
        engines=ENGINES,
        capacity=2,
        journal_path=tmp_path / "j.sqlite",
        clock=clock,
        sleep=gate.sleep,
    )
    try:
        await publish_by_verbs(reg, "A", ENGINES)
        assert not reg.sweeping  # nothing could ever expire: no task to run
        await reg.open_named(
            request_id=new_request_id(), name="chat-1", session_key="k1", lease=None
        )
        assert reg.sweeping  # a name's tombstone will have to be forgotten one day
    finally:
        await reg.aclose()


async def test_a_deployment_starts_its_registrys_sweeper(tmp_path: Path) -> None:
    journal, clock, gate = tmp_path / "j.sqlite", FakeClock(0.0), SweepGate()
    await dead_worker_journal(journal, clock)
    reg = reopen(journal, clock, gate)
    with ScriptedFleet(ENGINES) as fleet:
        settings = fleet.settings(owner_id="trainer")
        options = {"store_root": str(tmp_path / "store")}
        async with Deployment.from_settings(settings, registry=reg, backend_options=options) as d:
            assert reg.sweeping
            assert (await d.status()).leases[0].expires_at == REOPENED_AT + TTL
            result = await d.publish("C", tiny_snapshot(3))
            assert result.outcome is PublicationOutcome.SKIPPED  # A is pinned by the dead worker
            clock.t = REOPENED_AT + TTL
            await gate.round()
            await d.reclaimer.settled()  # the sweep's release woke the reclaimer
            assert reg.core.version("A").state is VersionState.RECLAIMED
            result = await d.publish("C", tiny_snapshot(3))
            assert result.outcome is PublicationOutcome.PUBLISHED
            assert d.versioning.lease is not None
            assert reg.core.status().leases == ()  # this process never opened one
        await reg.aclose()


async def test_a_killed_worker_process_releases_its_refs_in_a_reopened_process(
    tmp_path: Path,
) -> None:
    """A real process holding two bound Sessions is killed -9; this process reopens its journal,
    opens no Session, and sees the refs released (never before the TTL) and C published."""
    report = await dead_worker_reopened(tmp_path)
    print(report.as_dict())
    assert problems_of(report) == []
