"""Every fleet worker (publisher, reclaimer, repairer) refuses a registry whose fleet is not its
own, with one error: a deployment mistake for a human, never retried and never half-acted on."""

from __future__ import annotations

from pathlib import Path

import pytest
from agentic_lora_http import HttpPushBackend

from agentic_lora.errors import ConfigurationError
from agentic_lora.publication.publisher import Publisher
from agentic_lora.publication.reclaimer import Reclaimer
from agentic_lora.publication.repair import Repairer
from agentic_lora.publication.repair import SnapshotCache
from agentic_lora.publication.steps import FleetWorker
from agentic_lora.registry.local import LocalRegistry
from agentic_lora.testing.fleet import ScriptedFleet
from tests.publication.support import FAST
from tests.publication.support import A

pytestmark = pytest.mark.asyncio


def _workers(
    registry: LocalRegistry, backend: HttpPushBackend, fleet: ScriptedFleet
) -> list[FleetWorker]:
    one = fleet.refs[:1]  # the registry's fleet is e0 and e1
    return [
        Publisher(registry, backend, one, registry_retry=FAST),
        Reclaimer(registry, backend, one, registry_retry=FAST),
        Repairer(registry, backend, one, snapshots=SnapshotCache(), registry_retry=FAST),
    ]


async def test_each_worker_names_itself_and_both_fleets_in_the_same_error(tmp_path: Path) -> None:
    registry = LocalRegistry(engines=("e0", "e1"), capacity=2, sweep_interval=None)
    backend = HttpPushBackend(tmp_path / "store")
    try:
        with ScriptedFleet() as fleet:
            workers = _workers(registry, backend, fleet)
            assert [w.role for w in workers] == ["publisher", "reclaimer", "repairer"]
            for worker in workers:
                worker.check_fleet(["e0"])  # its own fleet: nothing to refuse
                with pytest.raises(ConfigurationError) as err:
                    worker.check_fleet(["e2", "e0", "e1"])
                assert err.value.code == "CONFIG_ERROR"
                assert err.value.details == {
                    "check": "fleet",
                    "role": worker.role,
                    "engines": ["e0"],
                    "registry": ["e0", "e1", "e2"],
                }
                assert str(err.value) == (
                    f"CONFIG_ERROR: {worker.role} fleet ['e0'] is not the registry's "
                    "['e0', 'e1', 'e2']"
                )
    finally:
        await backend.aclose()
        await registry.aclose()


async def test_a_publisher_on_another_fleet_loads_nothing(tmp_path: Path) -> None:
    registry = LocalRegistry(engines=("e0", "e1"), capacity=2, sweep_interval=None)
    backend = HttpPushBackend(tmp_path / "store")
    try:
        with ScriptedFleet() as fleet:
            publisher = Publisher(registry, backend, fleet.refs[:1], registry_retry=FAST)
            with pytest.raises(ConfigurationError) as err:
                await publisher.publish("v1", A)
            assert err.value.details["check"] == "fleet"
            assert fleet.calls() == 0  # no engine was called
    finally:
        await backend.aclose()
        await registry.aclose()
