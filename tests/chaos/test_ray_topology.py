"""Chaos on the Ray topology: rollout worker processes and the registry actor's process die.

Topology: a local Ray cluster (started by this module), one named, detached, journaled registry
actor (:func:`~agentic_lora.registry.ray_actor.connect`), two rollout worker processes
(``python -m tests.chaos.worker``: each its own OS process with a Versioning, an owner lease kept
by its LeaseKeeper under a stable owner id, and four example agents), and the test process as
the one publishing process (a :class:`~agentic_lora.assembly.deployment.Deployment` on the actor's
client: publisher, reclaimer, resolver; its own Sessions unused). Engines are the session's
shared fleet behind :class:`~tests.chaos.support.EngineTap` s; the workers' requests go through
the taps too, so the engine side sees every worker's Sessions.

* The rollout worker fault: a seeded worker is killed -9 after a seeded number of its answered
  generations and left dead: its Sessions' refs must come back when its lease expires (TTL 5 s),
  so retired versions it pinned get reclaimed and publications go on. It is then started again
  under the same owner id, holding Sessions under a lease with a two-minute TTL, killed again and
  restarted at once: the new incarnation must release its predecessor's refs without waiting
  for that TTL.
* The registry actor fault: the actor's process (``pid()``) is killed -9 at a seeded point; Ray
  restarts it from its journal. Calls in flight lose their replies and are replayed with their
  request ids; nothing is lost.

Verdicts (``FaultReport.problems``) as in the other chaos tests: one adapter per Session at the
engine side; a request that starts after the fault fails only by a typed refusal (refused,
nothing sent, e.g. a bind while the actor is away, replayed later with its request id; or
SESSION_EXPIRED); every commit kept, no leaked slot; a publication within lease TTL + 30 s;
every retired version reclaimed once the load stops. The killed worker's lease must end no
earlier than half its TTL after the kill (else the check watched the wrong lease), and the
restarted worker must end its predecessor's two-minute lease long before that TTL.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from agentic_lora_harness.engines import EngineFleet

from tests.chaos.scenarios import RAY_NAMESPACE
from tests.chaos.scenarios import ray_topology
from tests.chaos.support import local_ray_cluster

pytest.importorskip("ray")

pytestmark = [pytest.mark.engine, pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    with local_ray_cluster(RAY_NAMESPACE):
        yield


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("fault", "name"),
    [
        pytest.param("worker", "worker", id="rollout-worker"),
        pytest.param("actor", "registry-actor", id="registry-actor"),
    ],
)
async def test_killed_under_load(
    fault: str,
    name: str,
    ray_cluster: None,
    chaos_fleet: EngineFleet,
    tmp_path: Path,
    rng: random.Random,
) -> None:
    report = await ray_topology(chaos_fleet, tmp_path, rng, fault=fault, name=name)
    print(report.summary(), f"\n  report: {report.write(tmp_path / 'report.json')}")
    assert report.problems == []
