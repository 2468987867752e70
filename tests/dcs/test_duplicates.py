"""Duplicated and replayed control messages never drive a second collective or a second load."""

from __future__ import annotations

import asyncio

import pytest

from agentic_lora.errors import BackendAmbiguousError, BackendRefusedError
from tests.dcs.conftest import Cases, Publisher

pytestmark = [pytest.mark.dcs, pytest.mark.asyncio, pytest.mark.timeout(60)]


async def test_duplicate_bucket_messages_drive_exactly_one_collective_per_bucket(
    cases: Cases, publisher: Publisher
) -> None:
    case = cases("E0", seed=11, version_id="dup-bucket")
    publisher.edge.duplicate("/bucket")

    receipt = await publisher.prepare(case)

    assert receipt.lora_name == case.name
    # Every bucket message reached the sidecar twice...
    assert len(publisher.edge.bodies("/bucket")) == 2 * case.buckets
    # ...yet each side entered exactly one collective per bucket.
    assert await case.collectives() == case.buckets
    assert publisher.backend.collectives.of(case.name, 1) == case.buckets
    assert await case.served() == case.snapshot.digest

    # A duplicate that arrives after the attempt is READY is answered from the record.
    late = await case.resend("/bucket", publisher.edge.bodies("/bucket")[0])
    assert late.status_code == 200
    assert late.json()["state"] == "RECEIVED"
    assert late.json()["duplicate"] is True
    assert await case.collectives() == case.buckets


async def test_lost_bucket_reply_is_asked_again_without_a_second_collective(
    cases: Cases, publisher: Publisher
) -> None:
    case = cases("E1", seed=12, version_id="lost-bucket-ack")
    # Bucket 1 is armed by the sidecar but its ARMED reply never reaches the publisher.
    publisher.edge.lose_reply("/bucket", after=1)

    receipt = await publisher.prepare(case)

    assert receipt.attempt == 1
    assert len(publisher.edge.bodies("/bucket")) == case.buckets + 1
    assert await case.collectives() == case.buckets
    assert publisher.backend.collectives.of(case.name, 1) == case.buckets
    assert await case.served() == case.snapshot.digest


async def test_lost_end_reply_returns_the_same_ready_without_a_second_load(
    cases: Cases, publisher: Publisher
) -> None:
    case = cases("E0", seed=13, version_id="lost-end-ack")
    publisher.edge.lose_reply("/end")

    receipt = await publisher.prepare(case)

    assert receipt.digest == case.snapshot.digest
    assert len(publisher.edge.bodies("/end")) == 2
    assert await case.loads() == 1
    assert await case.named_calls("load") == 1


async def test_reentrant_prepare_of_one_attempt_shares_one_driver(
    cases: Cases, publisher: Publisher
) -> None:
    case = cases("E1", seed=14, version_id="reentrant")

    first, second = await asyncio.gather(publisher.prepare(case), publisher.prepare(case))

    assert first == second
    assert len(publisher.edge.bodies("/begin")) == 1
    assert len(publisher.edge.bodies("/bucket")) == case.buckets
    assert await case.collectives() == case.buckets
    assert await case.loads() == 1


async def test_a_new_driver_confirms_a_load_whose_reply_was_lost_without_loading_again(
    cases: Cases, publisher: Publisher
) -> None:
    case = cases("E0", seed=15, version_id="load-reply-lost")
    # The engine loads, but its answer to the sidecar is lost: the sidecar cannot know.
    await case.script("load", "lose_reply")

    await publisher.prepare_fails(case, BackendAmbiguousError, "ENGINE_UNCERTAIN")
    assert await case.state() == "UNCERTAIN"

    # The publisher prepares the same attempt again: a new driver, no new transfer; the sidecar
    # finds the adapter listed at its directory and confirms it.
    receipt = await publisher.prepare(case)

    assert receipt.digest == case.snapshot.digest
    assert await case.state() == "READY"
    assert await case.loads() == 1
    assert len(publisher.edge.bodies("/begin")) == 2
    assert publisher.backend.collectives.of(case.name, 1) == case.buckets


async def test_a_new_driver_restarts_an_attempt_that_failed_cleanly(
    cases: Cases, publisher: Publisher
) -> None:
    case = cases("E1", seed=16, version_id="retry-after-refusal")
    await case.script("load", "refuse")

    await publisher.prepare_fails(case, BackendRefusedError, "ENGINE_REFUSED")
    # A refused load leaves nothing behind: not served, no directory, the attempt FAILED.
    assert await case.served() is None
    assert not case.stored()
    assert await case.state() == "FAILED"
    # The refused driver's own Begin, repeated, still gets the root cause...
    repeat = await case.resend("/begin", publisher.edge.bodies("/begin")[0])
    assert repeat.json()["reason"] == "ENGINE_REFUSED"
    # ...while a new driver starts the attempt over: nothing of it was held.
    receipt = await publisher.prepare(case)

    assert receipt.attempt == 1
    assert await case.loads() == 1
    assert publisher.backend.collectives.of(case.name, 1) == 2 * case.buckets
