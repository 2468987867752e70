"""Stale attempts and early cleanups are fenced: nothing is recreated, nothing newer is touched."""

from __future__ import annotations

import httpx
import pytest
from agentic_lora_dcs.client import SidecarClient
from agentic_lora_dcs.plan import plan_for_snapshot
from agentic_lora_dcs.protocol import (
    PROTOCOL_VERSION,
    BeginRequest,
    BucketRequest,
    CleanupOutcome,
    CleanupRequest,
    EndRequest,
)

from agentic_lora.errors import BackendRefusedError
from tests.dcs.conftest import Publisher
from tests.dcs.util import (
    BUCKET_BYTES,
    SIDECAR_TOKEN,
    SidecarProcess,
    make_snapshot,
    resend,
    target_for,
)

pytestmark = [pytest.mark.dcs, pytest.mark.timeout(60)]


@pytest.mark.asyncio
async def test_cleanup_before_begin_leaves_a_fence_that_refuses_the_late_begin(
    sidecars: dict[str, SidecarProcess], http: httpx.AsyncClient, publisher: Publisher
) -> None:
    e0 = sidecars["E0"]
    snapshot = make_snapshot(seed=21)
    target = target_for(snapshot, "cleanup-first")

    # The publisher gave up on the attempt; its cleanup overtakes the Begin still in flight.
    await publisher.backend.cleanup(e0.engine, target)
    with pytest.raises(BackendRefusedError) as refused:
        await publisher.backend.prepare(e0.engine, target, snapshot)

    assert refused.value.details["reason"] == "FENCED"
    assert publisher.edge.bodies("/bucket") == []
    view = await e0.attempt(http, target.lora_name, 1)
    assert view == {
        "lora_name": target.lora_name,
        "attempt": 1,
        "state": "CLEANED",
        "buckets_armed": 0,
        "buckets_received": 0,
        "collectives": 0,
        "drivers": 0,
    }
    engine = await e0.engine_state(http)
    assert target.lora_name not in engine["physical_loads"]
    assert not (e0.store_dir / target.lora_name).exists()
    assert publisher.backend.collectives.of(target.lora_name, 1) == 0


@pytest.mark.asyncio
async def test_late_messages_of_a_cleaned_attempt_are_refused_and_never_touch_the_newer_one(
    sidecars: dict[str, SidecarProcess], http: httpx.AsyncClient, publisher: Publisher
) -> None:
    e0 = sidecars["E0"]
    snapshot = make_snapshot(seed=22)
    first = target_for(snapshot, "stale-after-cleanup", attempt=1)
    second = target_for(snapshot, "stale-after-cleanup", attempt=2)
    buckets = len(plan_for_snapshot(snapshot, BUCKET_BYTES).buckets)

    await publisher.backend.prepare(e0.engine, first, snapshot)
    old_begin = publisher.edge.bodies("/begin")[0]
    old_bucket = publisher.edge.bodies("/bucket")[0]
    old_end = publisher.edge.bodies("/end")[0]
    await publisher.backend.cleanup(e0.engine, first)  # aborted: unloaded, directory removed
    await publisher.backend.prepare(e0.engine, second, snapshot)
    before = await e0.engine_state(http)

    # Attempt 1's Begin, bucket and End (READY) arrive again, late.
    for path, body in (("/begin", old_begin), ("/bucket", old_bucket), ("/end", old_end)):
        reply = await resend(http, e0.url + path, body)
        assert reply.status_code == 409, path
        assert reply.json()["reason"] == "FENCED", path
        assert reply.json()["clean"] is True, path
    # So does its cleanup: it must not unload what attempt 2 loaded under the same name.
    stale_cleanup = await resend(
        http,
        e0.url + "/cleanup",
        CleanupRequest(lora_name=first.lora_name, attempt=1).model_dump_json().encode(),
    )
    assert stale_cleanup.json()["outcome"] == CleanupOutcome.ALREADY_CLEAN

    after = await e0.engine_state(http)
    assert after["physical_loads"] == before["physical_loads"]
    assert after["physical_unloads"] == before["physical_unloads"]
    assert after["adapters"][second.lora_name] == snapshot.digest
    assert (e0.store_dir / second.lora_name).is_dir()
    old = await e0.attempt(http, first.lora_name, 1)
    new = await e0.attempt(http, second.lora_name, 2)
    assert old is not None
    assert new is not None
    assert (old["state"], old["collectives"]) == ("CLEANED", buckets)
    assert (new["state"], new["collectives"]) == ("READY", buckets)
    assert await e0.stash_bytes(http) == 0


@pytest.mark.asyncio
async def test_messages_of_an_older_attempt_never_seen_here_are_refused_as_stale(
    sidecars: dict[str, SidecarProcess], http: httpx.AsyncClient, publisher: Publisher
) -> None:
    e1 = sidecars["E1"]
    snapshot = make_snapshot(seed=23)
    newer = target_for(snapshot, "stale-never-seen", attempt=2)
    await publisher.backend.prepare(e1.engine, newer, snapshot)
    incarnation = await publisher.backend.incarnation(e1.engine)

    # Attempt 1's messages were delayed in the network and only arrive now.
    client = SidecarClient(e1.url, engine="E1", client=http, end_timeout=30.0, token=SIDECAR_TOKEN)
    plan = plan_for_snapshot(snapshot, BUCKET_BYTES)
    begin = BeginRequest(
        driver="1a7e0001",
        lora_name=newer.lora_name,
        attempt=1,
        version_id=newer.version_id,
        digest=snapshot.digest,
        incarnation=incarnation,
        config=dict(snapshot.manifest.to_dict()["config"]),
        plan=plan,
        backend="gloo",
        protocol=PROTOCOL_VERSION,
    )
    with pytest.raises(BackendRefusedError) as late_begin:
        await client.begin(begin)
    bucket = BucketRequest(lora_name=newer.lora_name, attempt=1, incarnation=incarnation, index=0)
    with pytest.raises(BackendRefusedError) as late_bucket:
        await client.bucket(bucket)
    end = EndRequest(lora_name=newer.lora_name, attempt=1, incarnation=incarnation)
    with pytest.raises(BackendRefusedError) as late_end:
        await client.end(end)

    for refused in (late_begin, late_bucket, late_end):
        assert refused.value.details["reason"] == "STALE_ATTEMPT"
        assert refused.value.details["newest"] == 2
    assert await e1.attempt(http, newer.lora_name, 1) is None
    engine = await e1.engine_state(http)
    assert engine["physical_loads"][newer.lora_name] == 1
    assert await e1.stash_bytes(http) == 0
