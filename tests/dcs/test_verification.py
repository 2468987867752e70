"""Bytes that do not match the manifest are refused cleanly and nothing reaches the engine."""

from __future__ import annotations

import asyncio
import datetime

import httpx
import pytest
from agentic_lora_dcs.client import SidecarClient
from agentic_lora_dcs.collective import AttemptGroup, CollectiveCounter, connect_store
from agentic_lora_dcs.plan import BucketPlan, plan_for_snapshot
from agentic_lora_dcs.protocol import (
    PROTOCOL_VERSION,
    BeginRequest,
    BucketRequest,
    BucketState,
    CleanupOutcome,
    CleanupRequest,
    EndRequest,
)

from agentic_lora.adapters.snapshot import AdapterSnapshot
from agentic_lora.engines.backends import PublicationTarget
from agentic_lora.errors import BackendRefusedError
from agentic_lora.foundation.identity import thaw_json
from tests.dcs.conftest import Publisher
from tests.dcs.util import (
    BUCKET_BYTES,
    SIDECAR_TOKEN,
    SidecarProcess,
    make_snapshot,
    state_of,
    target_for,
)

pytestmark = [pytest.mark.dcs, pytest.mark.timeout(60)]


def _begin(
    target: PublicationTarget,
    snapshot: AdapterSnapshot,
    incarnation: str,
    plan: BucketPlan,
    *,
    version_id: str | None = None,
) -> BeginRequest:  # type: ignore[type-arg]
    """Attempt 1's Begin for ``target`` claiming ``snapshot``'s digest and config."""
    return BeginRequest(
        driver="d0d0d0d0",
        lora_name=target.lora_name,
        attempt=1,
        version_id=version_id or target.version_id,
        digest=snapshot.digest,
        incarnation=incarnation,
        config=thaw_json(snapshot.config),
        plan=plan,
        backend="gloo",
        protocol=PROTOCOL_VERSION,
    )


@pytest.mark.asyncio
async def test_corrupted_bytes_in_transit_are_a_clean_refusal_and_nothing_is_loaded(
    sidecars: dict[str, SidecarProcess], http: httpx.AsyncClient
) -> None:
    e0 = sidecars["E0"]
    snapshot = make_snapshot(seed=31)
    target = target_for(snapshot, "corrupt-in-transit")
    plan = plan_for_snapshot(snapshot, BUCKET_BYTES)
    last = plan.buckets[-1].index
    client = SidecarClient(e0.url, engine="E0", client=http, end_timeout=30.0, token=SIDECAR_TOKEN)
    incarnation = (await client.incarnation()).incarnation

    # A sender that follows the protocol but whose last bucket loses one bit on the way.
    began = await client.begin(_begin(target, snapshot, incarnation, plan))
    rv = began.rendezvous
    counter = CollectiveCounter()
    group = await asyncio.to_thread(
        AttemptGroup.join,
        store=connect_store(rv.host, rv.port, timeout=datetime.timedelta(seconds=20)),
        prefix=rv.prefix,
        rank=0,
        backend="gloo",
        local_host="127.0.0.1",
        timeout=datetime.timedelta(seconds=20),
        label=(target.lora_name, 1),
        counter=counter,
    )
    tensors = {t.name: t.data for t in snapshot.tensors}
    try:
        for bucket in plan.buckets:
            reply = await client.bucket(
                BucketRequest(
                    lora_name=target.lora_name,
                    attempt=1,
                    incarnation=incarnation,
                    index=bucket.index,
                )
            )
            assert reply.state is BucketState.ARMED
            data = plan.pack(bucket.index, tensors)
            if bucket.index == last:
                data[len(data) // 2] ^= 0x01
            await asyncio.to_thread(group.send, data)
        with pytest.raises(BackendRefusedError) as refused:
            await client.end(
                EndRequest(lora_name=target.lora_name, attempt=1, incarnation=incarnation)
            )
    finally:
        group.close()

    assert refused.value.details["reason"] == "CHECKSUM_MISMATCH"
    assert counter.total == len(plan.buckets)
    assert await state_of(e0, http, target.lora_name, 1) == "FAILED"
    assert await e0.stash_bytes(http) == 0
    engine = await e0.engine_state(http)
    assert target.lora_name not in engine["physical_loads"]
    assert not (e0.store_dir / target.lora_name).exists()
    # The publisher's cleanup confirms there is nothing left.
    cleanup = await client.cleanup(CleanupRequest(lora_name=target.lora_name, attempt=1))
    assert cleanup.outcome is CleanupOutcome.ALREADY_CLEAN


@pytest.mark.asyncio
async def test_a_manifest_that_does_not_hash_to_the_digest_is_refused_at_begin(
    sidecars: dict[str, SidecarProcess], http: httpx.AsyncClient
) -> None:
    e1 = sidecars["E1"]
    claimed = make_snapshot(seed=32)
    other = make_snapshot(seed=33)
    target = target_for(claimed, "manifest-mismatch")
    client = SidecarClient(e1.url, engine="E1", client=http, end_timeout=30.0, token=SIDECAR_TOKEN)
    incarnation = (await client.incarnation()).incarnation

    with pytest.raises(BackendRefusedError) as wrong_manifest:
        await client.begin(
            _begin(target, claimed, incarnation, plan_for_snapshot(other, BUCKET_BYTES))
        )
    good = plan_for_snapshot(claimed, BUCKET_BYTES)
    repacked = BucketPlan(bucket_bytes=good.bucket_bytes * 2, buckets=good.buckets)
    with pytest.raises(BackendRefusedError) as bad_plan:
        await client.begin(_begin(target, claimed, incarnation, repacked))
    with pytest.raises(BackendRefusedError) as wrong_name:
        await client.begin(_begin(target, claimed, incarnation, good, version_id="another-id"))

    assert wrong_manifest.value.details["reason"] == "MANIFEST_MISMATCH"
    assert bad_plan.value.details["reason"] == "BAD_PLAN"
    assert wrong_name.value.details["reason"] == "MANIFEST_MISMATCH"
    assert await e1.attempt(http, target.lora_name, 1) is None
    assert target.lora_name not in (await e1.engine_state(http))["physical_loads"]


@pytest.mark.asyncio
async def test_a_snapshot_that_is_not_the_target_is_refused_before_any_message(
    sidecars: dict[str, SidecarProcess], publisher: Publisher
) -> None:
    snapshot = make_snapshot(seed=34)
    target = target_for(make_snapshot(seed=35), "snapshot-mismatch")

    with pytest.raises(BackendRefusedError) as refused:
        await publisher.backend.prepare(sidecars["E0"].engine, target, snapshot)

    assert refused.value.details["reason"] == "SNAPSHOT_MISMATCH"
    assert publisher.edge.sent == []


@pytest.mark.asyncio
async def test_an_engine_that_refuses_the_load_leaves_nothing_behind(
    sidecars: dict[str, SidecarProcess], http: httpx.AsyncClient, publisher: Publisher
) -> None:
    e0 = sidecars["E0"]
    snapshot = make_snapshot(seed=36)
    target = target_for(snapshot, "load-refused")
    await e0.script(http, "load", "refuse")

    with pytest.raises(BackendRefusedError) as refused:
        await publisher.backend.prepare(e0.engine, target, snapshot)

    assert refused.value.details["reason"] == "ENGINE_REFUSED"
    assert target.lora_name not in (await e0.engine_state(http))["adapters"]
    assert not (e0.store_dir / target.lora_name).exists()
    assert await state_of(e0, http, target.lora_name, 1) == "FAILED"
