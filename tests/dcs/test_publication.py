"""The publisher, reclaimer and real registry drive DCS publications end to end (rules 7.1-1 to
7.1-4).

Engines are scripted behind two real sidecar processes; every prepare moves its bytes over real
gloo groups. Prefix ``dcs_e2e`` keeps these versions apart from the other tests' names.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
import pytest_asyncio
from agentic_lora_dcs import DcsBackend

from agentic_lora.errors import StaleAttemptError
from agentic_lora.foundation.identity import VersionRef
from agentic_lora.publication.publisher import PublicationOutcome
from agentic_lora.publication.publisher import Publisher
from agentic_lora.publication.reclaimer import Reclaimer
from agentic_lora.registry.local import LocalRegistry
from agentic_lora.registry.types import ReadyReceipt
from agentic_lora.registry.types import VersionState
from agentic_lora.registry.types import new_request_id
from tests.dcs.util import BUCKET_BYTES
from tests.dcs.util import SIDECAR_TOKEN
from tests.dcs.util import SidecarProcess
from tests.dcs.util import make_snapshot
from tests.dcs.util import state_of

pytestmark = [pytest.mark.dcs, pytest.mark.timeout(60)]


class Fleet:
    def __init__(self, sidecars: dict[str, SidecarProcess]) -> None:
        self.sidecars = sidecars
        self.engines = [s.engine for s in sidecars.values()]
        self.registry = LocalRegistry(
            engines=tuple(sidecars), capacity=2, deployment_epoch=0, prefix="dcs_e2e"
        )
        self.backend = DcsBackend(
            {n: s.url for n, s in sidecars.items()},
            bucket_bytes=BUCKET_BYTES,
            collective_backend="gloo",
            sidecar_token=SIDECAR_TOKEN,
        )
        self.reclaimer = Reclaimer(self.registry, self.backend, self.engines)
        self.publisher = Publisher(self.registry, self.backend, self.engines)

    async def aclose(self) -> None:
        await self.backend.aclose()
        await self.registry.aclose()


@pytest_asyncio.fixture
async def fleet(sidecars: dict[str, SidecarProcess]) -> AsyncIterator[Fleet]:
    f = Fleet(sidecars)
    try:
        yield f
    finally:
        await f.aclose()


async def _loads(fleet: Fleet, http: httpx.AsyncClient, lora_name: str) -> dict[str, int]:
    out = {}
    for name, sidecar in fleet.sidecars.items():
        out[name] = int((await sidecar.engine_state(http))["physical_loads"].get(lora_name, 0))
    return out


async def _unloads(fleet: Fleet, http: httpx.AsyncClient, lora_name: str) -> dict[str, int]:
    out = {}
    for name, sidecar in fleet.sidecars.items():
        out[name] = int((await sidecar.engine_state(http))["physical_unloads"].get(lora_name, 0))
    return out


async def _attempt_count(fleet: Fleet, http: httpx.AsyncClient) -> int:
    count = 0
    for sidecar in fleet.sidecars.values():
        count += len((await sidecar.status(http))["attempts"])
    return count


@pytest.mark.asyncio
async def test_publish_retire_refuse_reclaim_fail_clean_and_retry_through_dcs(
    fleet: Fleet, http: httpx.AsyncClient
) -> None:
    registry = fleet.registry
    a, b, c = make_snapshot(seed=81), make_snapshot(seed=82), make_snapshot(seed=83)

    # Bootstrap A, bind an old Session to it, then publish B: A retires, B is the default.
    first = await fleet.publisher.publish("A", a)
    assert first.outcome is PublicationOutcome.PUBLISHED
    old = await registry.bind_first(request_id=new_request_id(), session_key="s-old")
    assert old.version_id == "A"
    second = await fleet.publisher.publish("B", b)
    assert second.outcome is PublicationOutcome.PUBLISHED
    assert (await registry.status()).default_version == "B"
    assert first.lora_name is not None
    assert second.lora_name is not None
    assert await _loads(fleet, http, second.lora_name) == {"E0": 1, "E1": 1}

    # Capacity 2, A retired but still bound, B published: C is refused before any transfer.
    attempts_before = await _attempt_count(fleet, http)
    skipped = await fleet.publisher.publish("C", c)
    assert skipped.outcome is PublicationOutcome.SKIPPED
    assert await _attempt_count(fleet, http) == attempts_before

    # The last A Session ends: A is reclaimed through both sidecars, one unload each.
    await registry.begin_close(request_id=new_request_id(), session_key="s-old")
    await registry.release(request_id=new_request_id(), session_key="s-old")
    report = await fleet.reclaimer.reclaim_once()
    assert report.reclaimed == ("A",)
    assert await _unloads(fleet, http, first.lora_name) == {"E0": 1, "E1": 1}
    assert registry.state_of("A") is VersionState.RECLAIMED

    # C now fits, but E1's engine refuses the load: C is cleaned on both engines, slot freed.
    await fleet.sidecars["E1"].script(http, "load", "refuse")
    failed = await fleet.publisher.publish("C", c)
    assert failed.outcome is PublicationOutcome.FAILED_CLEAN
    assert failed.lora_name is not None
    assert (await registry.status()).default_version == "B"
    for sidecar in fleet.sidecars.values():
        assert await state_of(sidecar, http, failed.lora_name, 1) == "CLEANED"
    assert await _unloads(fleet, http, failed.lora_name) == {"E0": 1, "E1": 0}

    # Retried: a new attempt publishes C; the old attempt's READY, replayed late, is stale.
    retried = await fleet.publisher.publish("C", c)
    assert retried.outcome is PublicationOutcome.PUBLISHED
    assert retried.attempt == 2
    assert (await registry.status()).default_version == "C"
    assert await _loads(fleet, http, failed.lora_name) == {"E0": 2, "E1": 1}
    incarnation = await fleet.backend.incarnation(fleet.sidecars["E0"].engine)
    stale = ReadyReceipt("E0", VersionRef("C", c.digest, failed.lora_name, 1), incarnation)
    with pytest.raises(StaleAttemptError):
        await registry.record_ready(request_id=new_request_id(), receipt=stale)
