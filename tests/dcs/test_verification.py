"""Bytes that do not match the manifest are refused cleanly and nothing reaches the engine."""

from __future__ import annotations

import asyncio
import datetime

import pytest
from agentic_lora_dcs.collective import AttemptGroup
from agentic_lora_dcs.collective import CollectiveCounter
from agentic_lora_dcs.collective import connect_store
from agentic_lora_dcs.plan import BucketPlan
from agentic_lora_dcs.plan import plan_for_snapshot
from agentic_lora_dcs.protocol import BucketRequest
from agentic_lora_dcs.protocol import BucketState
from agentic_lora_dcs.protocol import CleanupOutcome
from agentic_lora_dcs.protocol import CleanupRequest
from agentic_lora_dcs.protocol import EndRequest

from agentic_lora.errors import BackendRefusedError
from tests.dcs.conftest import Cases
from tests.dcs.conftest import Publisher
from tests.dcs.util import BUCKET_BYTES
from tests.dcs.util import make_snapshot

pytestmark = [pytest.mark.dcs, pytest.mark.asyncio, pytest.mark.timeout(60)]


async def test_corrupted_bytes_in_transit_are_a_clean_refusal_and_nothing_is_loaded(
    cases: Cases,
) -> None:
    case = cases("E0", seed=31, version_id="corrupt-in-transit")
    plan = plan_for_snapshot(case.snapshot, BUCKET_BYTES)
    last = plan.buckets[-1].index
    client = case.client()
    incarnation = (await client.incarnation()).incarnation

    # A sender that follows the protocol but whose last bucket loses one bit on the way.
    began = await client.begin(case.begin(incarnation, plan))
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
        label=(case.name, 1),
        counter=counter,
    )
    tensors = {t.name: t.data for t in case.snapshot.tensors}
    try:
        for bucket in plan.buckets:
            reply = await client.bucket(
                BucketRequest(
                    lora_name=case.name, attempt=1, incarnation=incarnation, index=bucket.index
                )
            )
            assert reply.state is BucketState.ARMED
            data = plan.pack(bucket.index, tensors)
            if bucket.index == last:
                data[len(data) // 2] ^= 0x01
            await asyncio.to_thread(group.send, data)
        with pytest.raises(BackendRefusedError) as refused:
            await client.end(EndRequest(lora_name=case.name, attempt=1, incarnation=incarnation))
    finally:
        group.close()

    assert refused.value.details["reason"] == "CHECKSUM_MISMATCH"
    assert counter.total == len(plan.buckets)
    assert await case.state() == "FAILED"
    assert await case.stash_bytes() == 0
    assert await case.loads() == 0
    assert not case.stored()
    # The publisher's cleanup confirms there is nothing left.
    cleanup = await client.cleanup(CleanupRequest(lora_name=case.name, attempt=1))
    assert cleanup.outcome is CleanupOutcome.ALREADY_CLEAN


async def test_a_manifest_that_does_not_hash_to_the_digest_is_refused_at_begin(
    cases: Cases,
) -> None:
    case = cases("E1", seed=32, version_id="manifest-mismatch")
    other = make_snapshot(seed=33)
    client = case.client()
    incarnation = (await client.incarnation()).incarnation

    with pytest.raises(BackendRefusedError) as wrong_manifest:
        await client.begin(case.begin(incarnation, plan_for_snapshot(other, BUCKET_BYTES)))
    good = plan_for_snapshot(case.snapshot, BUCKET_BYTES)
    repacked = BucketPlan(bucket_bytes=good.bucket_bytes * 2, buckets=good.buckets)
    with pytest.raises(BackendRefusedError) as bad_plan:
        await client.begin(case.begin(incarnation, repacked))
    with pytest.raises(BackendRefusedError) as wrong_name:
        await client.begin(case.begin(incarnation, version_id="another-id"))

    assert wrong_manifest.value.details["reason"] == "MANIFEST_MISMATCH"
    assert bad_plan.value.details["reason"] == "BAD_PLAN"
    assert wrong_name.value.details["reason"] == "MANIFEST_MISMATCH"
    assert await case.view() is None
    assert await case.loads() == 0


async def test_a_snapshot_that_is_not_the_target_is_refused_before_any_message(
    cases: Cases, publisher: Publisher
) -> None:
    case = cases("E0", seed=35, version_id="snapshot-mismatch")

    with pytest.raises(BackendRefusedError) as refused:
        await publisher.backend.prepare(case.sidecar.engine, case.target, make_snapshot(seed=34))

    assert refused.value.details["reason"] == "SNAPSHOT_MISMATCH"
    assert publisher.edge.sent == []
