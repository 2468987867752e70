"""Duplicated and replayed control messages never drive a second collective or a second load."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from agentic_lora.errors import BackendAmbiguousError
from agentic_lora.errors import BackendRefusedError
from tests.dcs.conftest import Cases
from tests.dcs.conftest import Publisher

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


@dataclass(frozen=True)
class FailedLoad:
    """A load that failed, and whether the engine still serves (the store still holds) it."""

    seed: int
    fault: str
    error: type[Exception]
    reason: str
    state: str
    held: bool


FAILED_LOADS = [
    # The engine loads, but its answer to the sidecar is lost: the sidecar cannot know.
    FailedLoad(15, "lose_reply", BackendAmbiguousError, "ENGINE_UNCERTAIN", "UNCERTAIN", True),
    # A refused load leaves nothing behind.
    FailedLoad(16, "refuse", BackendRefusedError, "ENGINE_REFUSED", "FAILED", False),
]


@pytest.mark.parametrize("failed", FAILED_LOADS, ids=["load-reply-lost", "retry-after-refusal"])
async def test_a_new_driver_after_a_failed_load_ends_ready_with_one_load(
    failed: FailedLoad, cases: Cases, publisher: Publisher, request: pytest.FixtureRequest
) -> None:
    case = cases("E0", seed=failed.seed, version_id=request.node.callspec.id)
    await case.script("load", failed.fault)

    await publisher.prepare_fails(case, failed.error, failed.reason)
    assert await case.state() == failed.state
    assert (await case.served() == case.snapshot.digest) is failed.held
    assert case.stored() is failed.held
    # The failed driver's own Begin, repeated, restarts nothing: a held attempt answers it as a
    # duplicate, a failed one with its root cause.
    repeat = (await case.resend("/begin", publisher.edge.bodies("/begin")[0])).json()
    assert repeat.get("duplicate", False) is failed.held
    assert repeat.get("reason") == (None if failed.held else failed.reason)
    # A new driver takes the attempt to READY: the sidecar confirms a held adapter at its
    # directory with no new transfer, and starts a failed attempt over.
    receipt = await publisher.prepare(case)

    assert (receipt.digest, receipt.attempt) == (case.snapshot.digest, 1)
    assert await case.state() == "READY"
    assert await case.loads() == 1
    assert len(publisher.edge.bodies("/begin")) == 2
    transfers = 1 if failed.held else 2
    assert publisher.backend.collectives.of(case.name, 1) == transfers * case.buckets
