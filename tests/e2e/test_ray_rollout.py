"""The Ray rollout example (``examples/ray_rollout``) on real engines, checked from the wire.

Topology: a local Ray cluster (this module's), the example's named, journaled registry actor, the
trainer's Deployment in this process (publisher, reclaimer), and rollout worker actors
(:class:`agentic_lora_rollout.RolloutWorker`, each its own process with its own Versioning, owner
lease and example agents). Every request of every process reaches the shared engines through an
:class:`~tests.chaos.support.EngineTap`, so the verdicts come from what the engines received:

* publications during the run: one adapter per Session, never the base model, every generation
  answered 200 and no agent attempt failed; every retired version unloaded from each engine after
  the last request that carried it, once the workers closed their Sessions;
* ``max_version_lag=0``: Sessions parked across a commit are refused ``VERSION_TOO_STALE`` at
  their next turn, and the refused request never reached an engine;
* a worker killed -9 while its Sessions hold a retired version: its lease (TTL two minutes) still
  holds their refs; a worker started for the same owner slot releases them when it opens its
  lease, and the version is unloaded while the surviving worker goes on.

Every wait is for an event (a worker's answered turns, its parked agents, a registry state) under
a generous guard; nothing is decided by which of two things finished first.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import uuid
from collections.abc import AsyncIterator
from collections.abc import Awaitable
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from agentic_lora_harness.engines import EngineFleet

from agentic_lora.adapters.snapshot import AdapterSnapshot
from agentic_lora.assembly.deployment import Deployment
from agentic_lora.config import AgenticLoRASettings
from agentic_lora.publication.publisher import PublicationOutcome
from agentic_lora.publication.publisher import PublicationResult
from agentic_lora.registry.ray_actor import RayRegistryClient
from agentic_lora.registry.types import RegistryStatus
from agentic_lora.registry.types import VersionState
from tests.chaos.scenarios import taps_on
from tests.chaos.support import GUARD_SECONDS
from tests.chaos.support import EngineTap
from tests.chaos.support import adapter_of
from tests.chaos.support import eventually
from tests.chaos.support import is_generation
from tests.chaos.support import local_ray_cluster
from tests.chaos.support import session_tag
from tests.chaos.support import wire_problems
from tests.e2e.recording_proxy import TrafficLog

ray = pytest.importorskip("ray")

from agentic_lora_rollout import REGISTRY_NAMESPACE  # noqa: E402
from agentic_lora_rollout import WorkerConfig  # noqa: E402
from agentic_lora_rollout import fleet_settings  # noqa: E402
from agentic_lora_rollout import reclaim_until_settled  # noqa: E402
from agentic_lora_rollout import registry_actor  # noqa: E402
from agentic_lora_rollout import rollout  # noqa: E402
from agentic_lora_rollout import spawn_worker  # noqa: E402
from agentic_lora_rollout import trainer_deployment  # noqa: E402
from agentic_lora_rollout import worker_settings  # noqa: E402

pytestmark = [pytest.mark.engine, pytest.mark.ray, pytest.mark.slow]

#: A lease TTL no step of a test comes near: only an owner restart can end such a lease in time.
LONG_LEASE_TTL = 120.0


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    with local_ray_cluster(REGISTRY_NAMESPACE):
        yield


async def _call(ref: Awaitable[Any], what: str) -> Any:
    """An actor call, bounded by the liveness guard."""
    try:
        async with asyncio.timeout(GUARD_SECONDS):
            return await ref
    except TimeoutError:
        raise AssertionError(f"never happened within {GUARD_SECONDS:.0f} s: {what}") from None


# --- reading the wire ----------------------------------------------------------------------------


def _generations(traffic: TrafficLog) -> list[Any]:
    return [e for e in traffic.exchanges if is_generation(e)]


def _unloads(traffic: TrafficLog, lora_name: str) -> dict[str, Any]:
    """Engine -> its successful ``/unload_lora_adapter`` of ``lora_name``."""
    return {
        e.engine: e
        for e in traffic.exchanges
        if e.path == "/unload_lora_adapter"
        and e.lora == lora_name
        and e.status == 200
        and isinstance(e.reply, dict)
        and e.reply.get("success") is True
    }


def _reclaim_problems(traffic: TrafficLog, engines: list[str], lora_name: str) -> list[str]:
    """``lora_name`` was unloaded from every engine, after every generation that carried it."""
    unloads = _unloads(traffic, lora_name)
    problems = [f"{lora_name} never unloaded from {e}" for e in engines if e not in unloads]
    for g in _generations(traffic):
        if adapter_of(g) != lora_name:
            continue
        u = unloads.get(g.engine)
        if u is not None and (g.seq_done is None or u.seq_sent < g.seq_done):
            problems.append(f"{lora_name} unloaded from {g.engine} before {g!r} ended")
    return problems


# --- the topology of the composed tests ---------------------------------------------------------


@dataclass
class Topology:
    fleet: EngineFleet
    traffic: TrafficLog
    taps: dict[str, EngineTap]
    #: The example's fleet settings (on the taps), which the registry and trainer were built from.
    settings: AgenticLoRASettings
    registry: RayRegistryClient
    registry_name: str
    deployment: Deployment
    tag: str
    handles: list[Any]

    def worker(
        self, owner: str, *, agents: int, lease_ttl: float, max_version_lag: int | None = None
    ) -> tuple[Any, WorkerConfig]:
        config = WorkerConfig(
            settings=worker_settings(
                self.settings,
                owner=f"{owner}-{self.tag}",
                lease_ttl=lease_ttl,
                max_version_lag=max_version_lag,
            ),
            registry_name=self.registry_name,
            namespace=REGISTRY_NAMESPACE,
            agents=agents,
        )
        return self.spawn(config), config

    def spawn(self, config: WorkerConfig) -> Any:
        handle = spawn_worker(config)
        self.handles.append(handle)
        return handle

    async def publish(self, label: str, letter: str) -> PublicationResult:
        snapshot = AdapterSnapshot.from_peft_dir(self.fleet.fixture.adapter(letter))
        result = await self.deployment.publish(f"{label}-{self.tag}", snapshot)
        assert result.outcome is PublicationOutcome.PUBLISHED, result
        return result

    async def version(self, result: PublicationResult) -> Any:
        status: RegistryStatus = await self.registry.status()
        return next(v for v in status.versions if v.version_id == result.version_id)


@pytest_asyncio.fixture
async def topology(
    ray_cluster: None, engines_restored: EngineFleet, tmp_path: Path
) -> AsyncIterator[Topology]:
    fleet = engines_restored
    traffic = TrafficLog()
    tag = uuid.uuid4().hex[:6]
    name = f"rollout-registry-{tag}"
    async with taps_on(fleet, traffic) as taps:
        settings = fleet_settings(
            {n: t.base_url for n, t in taps.items()}, base_model=fleet.served_model_name
        )
        registry = registry_actor(settings, name=name, journal=tmp_path / "registry.sqlite")
        deployment = trainer_deployment(registry, settings, store_root=tmp_path / "adapter-store")
        topo = Topology(fleet, traffic, taps, settings, registry, name, deployment, tag, [])
        try:
            async with deployment:
                yield topo
        finally:
            for h in topo.handles:
                with contextlib.suppress(Exception):
                    ray.kill(h, no_restart=True)
            with contextlib.suppress(Exception):
                ray.kill(registry.actor, no_restart=True)
        assert wire_problems(taps, traffic) == []


# --- the tests -----------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_rollout_workers_keep_one_version_per_session_while_versions_are_published(
    ray_cluster: None, engines_restored: EngineFleet, tmp_path: Path
) -> None:
    fleet = engines_restored
    traffic = TrafficLog()
    async with taps_on(fleet, traffic) as taps:
        report = await rollout(
            {n: t.base_url for n, t in taps.items()},
            base_model=fleet.served_model_name,
            adapters=[fleet.fixture.adapter(x) for x in "ABC"],
            workdir=tmp_path,
            workers=2,
            agents=2,
            turns_between=3,
        )
        wire = wire_problems(taps, traffic)
    assert report.problems() == []
    assert [p.outcome for p in report.publications] == [PublicationOutcome.PUBLISHED] * 3
    assert wire == []
    generations = _generations(traffic)
    assert generations
    assert [g for g in generations if g.status != 200] == []
    # Both workers' Sessions reached the engines, and Sessions bound each published version.
    tags = {session_tag(g) for g in generations} - {None}
    owners = {str(t).split(".", 1)[0] for t in tags}
    assert len(owners) == 2, owners
    names = [p.lora_name for p in report.publications]
    carried = {adapter_of(g) for g in generations if session_tag(g) is not None}
    assert set(names) <= carried, (names, carried)
    # What each Session's provenance names is what the engines received for it.
    for ep in report.episodes:
        sent = {adapter_of(g) for g in generations if session_tag(g) == ep["session"]}
        assert sent == {ep["provenance"]["lora_name"]}, ep["session"]
    for retired in names[:-1]:
        assert _reclaim_problems(traffic, fleet.names, str(retired)) == []
    assert report.episodes_path is not None
    written = report.episodes_path.read_text().splitlines()
    assert len(written) == len(report.episodes)


@pytest.mark.asyncio
async def test_max_version_lag_refuses_parked_sessions_before_any_engine_call(
    topology: Topology,
) -> None:
    topo = topology
    a = await topo.publish("step-0", "A")
    worker, _ = topo.worker("lagged", agents=2, max_version_lag=0, lease_ttl=LONG_LEASE_TTL)
    await _call(worker.start.remote(), "the worker started")
    parked = await _call(worker.hold.remote(), "every agent parked on a bound Session")
    assert {p["version"] for p in parked} == {a.version_id}
    mark = topo.traffic.mark("parked")
    b = await topo.publish("step-1", "B")
    assert b.commit is not None
    seen = await _call(worker.sync_revision.remote(), "the worker read the registry")
    assert seen == b.commit.default_revision
    await _call(worker.release.remote(), "release")
    refused = await _call(
        worker.wait_for_sessions.remote([p["session"] for p in parked]),
        "the parked Sessions' episodes ended",
    )
    assert len(refused) == len(parked)
    for ep in refused:
        assert ep["status"] == "failed", ep
        assert ep["error_code"] == "VERSION_TOO_STALE", ep
        assert ep["provenance"]["too_stale_lag"] == 1, ep
        assert ep["provenance"]["version_id"] == a.version_id
        assert set(ep["provenance"]["lags"]) == {0}, ep
        last = ep["attempts"][-1]
        assert last["error_code"] == "VERSION_TOO_STALE"
        # The refused request never reached an engine; nothing of this Session did after B.
        assert topo.traffic.select(rid=last["rid"]) == []
        assert [e for e in topo.traffic.since(mark) if session_tag(e) == ep["session"]] == []
    # New Sessions bind B and go on; then the worker stops and A is reclaimed.
    answered = await _call(worker.wait_answered.remote(0), "answered count")
    await _call(worker.wait_answered.remote(answered + 4), "turns on B")
    stopped = await _call(worker.stop.remote(), "the worker stopped")
    assert stopped["errors"] == []
    refused_ids = {ep["session"] for ep in refused}
    later = [ep for ep in stopped["episodes"] if ep["session"] not in refused_ids]
    assert any(ep["provenance"]["version_id"] == b.version_id for ep in later)
    for ep in later:
        assert [x for x in ep["attempts"] if x["outcome"] != "ok"] == [], ep
    final = await reclaim_until_settled(topo.deployment)
    assert {v.version_id: v.state for v in final.versions}[a.version_id] is VersionState.RECLAIMED
    assert _reclaim_problems(topo.traffic, topo.fleet.names, str(a.lora_name)) == []


@pytest.mark.asyncio
async def test_killed_worker_sessions_released_by_its_owner_restart(topology: Topology) -> None:
    topo = topology
    a = await topo.publish("step-0", "A")
    victim, victim_config = topo.worker("victim", agents=2, lease_ttl=LONG_LEASE_TTL)
    survivor, _ = topo.worker("survivor", agents=2, lease_ttl=LONG_LEASE_TTL)
    first = await _call(victim.start.remote(), "the victim started")
    await _call(survivor.start.remote(), "the survivor started")
    parked = await _call(victim.hold.remote(), "the victim's agents parked on bound Sessions")
    assert {p["version"] for p in parked} == {a.version_id}
    await topo.publish("step-1", "B")  # A is retired; the victim's Sessions still hold it
    pid = await _call(victim.pid.remote(), "the victim's pid")
    os.kill(pid, signal.SIGKILL)

    async def dead() -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False

    await eventually(dead, what=f"the victim's process {pid} is gone")
    kill_mark = topo.traffic.mark("victim killed")
    # The kill released nothing: the dead worker's lease and its Sessions' refs are still there.
    status: RegistryStatus = await topo.registry.status()
    lease = next(x for x in status.leases if x.lease_id == first["lease_id"])
    assert lease.sessions == len(parked)
    assert (await topo.version(a)).session_refs >= len(parked)
    # A worker started for the same slot releases them when it opens its lease.
    replacement = topo.spawn(victim_config)
    again = await _call(replacement.start.remote(), "the replacement started")
    assert sorted(again["released"]) == sorted(p["key"] for p in parked)
    status = await topo.registry.status()
    assert first["lease_id"] not in {x.lease_id for x in status.leases}

    # While the survivor goes on, A's last Sessions end and A is unloaded from every engine.
    async def reclaimed() -> bool:
        await topo.deployment.reclaim()
        return bool((await topo.version(a)).state is VersionState.RECLAIMED)

    await eventually(reclaimed, what=f"{a.version_id} reclaimed")
    assert _reclaim_problems(topo.traffic, topo.fleet.names, str(a.lora_name)) == []
    assert all(u.seq_sent > kill_mark for u in _unloads(topo.traffic, str(a.lora_name)).values())
    for handle in (survivor, replacement):
        stopped = await _call(handle.stop.remote(), "a worker stopped")
        assert stopped["errors"] == []
        for ep in stopped["episodes"]:
            assert [x for x in ep["attempts"] if x["outcome"] != "ok"] == [], ep
    await reclaim_until_settled(topo.deployment)
