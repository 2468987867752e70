"""A staged publication over real gloo process groups reaches READY with the exact bytes."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from agentic_lora_dcs import DcsBackend
from agentic_lora_dcs.plan import plan_for_snapshot

from agentic_lora.adapters.snapshot import AdapterSnapshot
from tests.dcs.util import SIDECAR_TOKEN
from tests.dcs.util import SidecarProcess
from tests.dcs.util import make_snapshot
from tests.dcs.util import target_for

pytestmark = [pytest.mark.dcs, pytest.mark.timeout(60)]

BUCKET_BYTES = 4096


@pytest.mark.asyncio
async def test_prepare_on_two_engines_reaches_ready_with_the_snapshot_bytes(
    sidecars: dict[str, SidecarProcess], http: httpx.AsyncClient
) -> None:
    snapshot = make_snapshot(seed=1)
    target = target_for(snapshot, "happy-1")
    plan = plan_for_snapshot(snapshot, BUCKET_BYTES)
    assert len(plan.buckets) > 1  # the test must exercise several collectives

    backend = DcsBackend(
        {n: s.url for n, s in sidecars.items()},
        bucket_bytes=BUCKET_BYTES,
        collective_backend="gloo",
        sidecar_token=SIDECAR_TOKEN,
    )
    try:
        receipts = await asyncio.gather(
            *(backend.prepare(s.engine, target, snapshot) for s in sidecars.values())
        )
        incarnations = {s.name: await backend.incarnation(s.engine) for s in sidecars.values()}
    finally:
        await backend.aclose()

    for receipt, sidecar in zip(receipts, sidecars.values(), strict=True):
        assert receipt.engine == sidecar.name
        assert (receipt.version_id, receipt.digest, receipt.lora_name, receipt.attempt) == (
            target.version_id,
            target.digest,
            target.lora_name,
            1,
        )
        assert receipt.incarnation == incarnations[sidecar.name]
        assert receipt.incarnation.startswith(sidecar.sidecar_id + "/")

        # The engine loaded exactly this content, pinned, once.
        engine = await sidecar.engine_state(http)
        assert engine["adapters"][target.lora_name] == snapshot.digest
        assert engine["pinned"][target.lora_name] is True
        assert engine["physical_loads"][target.lora_name] == 1

        # The materialised directory holds byte-identical tensors.
        stored = AdapterSnapshot.from_peft_dir(sidecar.store_dir / target.lora_name)
        assert stored.digest == snapshot.digest
        assert [(t.name, t.data) for t in stored.tensors] == [
            (t.name, t.data) for t in snapshot.tensors
        ]

        # One collective per bucket on the receiver, and the stash is gone.
        view = await sidecar.attempt(http, target.lora_name, 1)
        assert view is not None
        assert view["state"] == "READY"
        assert view["collectives"] == len(plan.buckets)
        assert view["buckets_received"] == len(plan.buckets)
        assert await sidecar.stash_bytes(http) == 0
    # ...and one per bucket per engine on the publisher.
    assert backend.collectives.of(target.lora_name, 1) == 2 * len(plan.buckets)
