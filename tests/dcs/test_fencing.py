"""Stale attempts and early cleanups are fenced: nothing is recreated, nothing newer is touched."""

from __future__ import annotations

import pytest
from agentic_lora_dcs.protocol import BucketRequest
from agentic_lora_dcs.protocol import CleanupOutcome
from agentic_lora_dcs.protocol import CleanupRequest
from agentic_lora_dcs.protocol import EndRequest

from agentic_lora.errors import BackendRefusedError
from tests.dcs.conftest import Cases
from tests.dcs.conftest import Publisher

pytestmark = [pytest.mark.dcs, pytest.mark.asyncio, pytest.mark.timeout(60)]


async def test_cleanup_before_begin_leaves_a_fence_that_refuses_the_late_begin(
    cases: Cases, publisher: Publisher
) -> None:
    case = cases("E0", seed=21, version_id="cleanup-first")

    # The publisher gave up on the attempt; its cleanup overtakes the Begin still in flight.
    await publisher.cleanup(case)
    await publisher.prepare_fails(case, BackendRefusedError, "FENCED")

    assert publisher.edge.bodies("/bucket") == []
    assert await case.view() == {
        "lora_name": case.name,
        "attempt": 1,
        "state": "CLEANED",
        "buckets_armed": 0,
        "buckets_received": 0,
        "collectives": 0,
        "drivers": 0,
    }
    assert await case.loads() == 0
    assert not case.stored()
    assert publisher.backend.collectives.of(case.name, 1) == 0


async def test_late_messages_of_a_cleaned_attempt_are_refused_and_never_touch_the_newer_one(
    cases: Cases, publisher: Publisher
) -> None:
    first = cases("E0", seed=22, version_id="stale-after-cleanup")
    second = first.attempt(2)

    await publisher.prepare(first)
    old_begin = publisher.edge.bodies("/begin")[0]
    old_bucket = publisher.edge.bodies("/bucket")[0]
    old_end = publisher.edge.bodies("/end")[0]
    await publisher.cleanup(first)  # aborted: unloaded, directory removed
    await publisher.prepare(second)
    before = await first.engine_state()

    # Attempt 1's Begin, bucket and End (READY) arrive again, late.
    for path, body in (("/begin", old_begin), ("/bucket", old_bucket), ("/end", old_end)):
        reply = await first.resend(path, body)
        assert reply.status_code == 409, path
        assert reply.json()["reason"] == "FENCED", path
        assert reply.json()["clean"] is True, path
    # So does its cleanup: it must not unload what attempt 2 loaded under the same name.
    stale_cleanup = await first.resend(
        "/cleanup", CleanupRequest(lora_name=first.name, attempt=1).model_dump_json().encode()
    )
    assert stale_cleanup.json()["outcome"] == CleanupOutcome.ALREADY_CLEAN

    after = await first.engine_state()
    assert after["physical_loads"] == before["physical_loads"]
    assert after["physical_unloads"] == before["physical_unloads"]
    assert after["adapters"][second.name] == second.snapshot.digest
    assert second.stored()
    old = await first.view(1)
    new = await second.view(2)
    assert old is not None
    assert new is not None
    assert (old["state"], old["collectives"]) == ("CLEANED", first.buckets)
    assert (new["state"], new["collectives"]) == ("READY", second.buckets)
    assert await first.stash_bytes() == 0


async def test_messages_of_an_older_attempt_never_seen_here_are_refused_as_stale(
    cases: Cases, publisher: Publisher
) -> None:
    stale = cases("E1", seed=23, version_id="stale-never-seen")
    newer = stale.attempt(2)
    await publisher.prepare(newer)
    incarnation = await publisher.backend.incarnation(newer.sidecar.engine)

    # Attempt 1's messages were delayed in the network and only arrive now.
    client = stale.client()
    with pytest.raises(BackendRefusedError) as late_begin:
        await client.begin(stale.begin(incarnation))
    bucket = BucketRequest(lora_name=newer.name, attempt=1, incarnation=incarnation, index=0)
    with pytest.raises(BackendRefusedError) as late_bucket:
        await client.bucket(bucket)
    end = EndRequest(lora_name=newer.name, attempt=1, incarnation=incarnation)
    with pytest.raises(BackendRefusedError) as late_end:
        await client.end(end)

    for refused in (late_begin, late_bucket, late_end):
        assert refused.value.details["reason"] == "STALE_ATTEMPT"
        assert refused.value.details["newest"] == 2
    assert await newer.view(1) is None
    assert await newer.loads() == 1
    assert await newer.stash_bytes() == 0
