"""Duplicated and replayed control messages never drive a second collective or a second load."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from agentic_lora_dcs.plan import plan_for_snapshot

from agentic_lora.errors import BackendAmbiguousError, BackendRefusedError
from tests.dcs.conftest import Publisher
from tests.dcs.util import (
    BUCKET_BYTES,
    SidecarProcess,
    calls_naming,
    make_snapshot,
    resend,
    state_of,
    target_for,
)

pytestmark = [pytest.mark.dcs, pytest.mark.timeout(60)]


async def _collectives(sidecar: SidecarProcess, http: httpx.AsyncClient, name: str) -> int:
    view = await sidecar.attempt(http, name, 1)
    assert view is not None
    return int(view["collectives"])


@pytest.mark.asyncio
async def test_duplicate_bucket_messages_drive_exactly_one_collective_per_bucket(
    sidecars: dict[str, SidecarProcess], http: httpx.AsyncClient, publisher: Publisher
) -> None:
    e0 = sidecars["E0"]
    snapshot = make_snapshot(seed=11)
    target = target_for(snapshot, "dup-bucket")
    buckets = len(plan_for_snapshot(snapshot, BUCKET_BYTES).buckets)
    publisher.edge.duplicate("/bucket")

    receipt = await publisher.backend.prepare(e0.engine, target, snapshot)

    assert receipt.lora_name == target.lora_name
    # Every bucket message reached the sidecar twice...
    assert len(publisher.edge.bodies("/bucket")) == 2 * buckets
    # ...yet each side entered exactly one collective per bucket.
    assert await _collectives(e0, http, target.lora_name) == buckets
    assert publisher.backend.collectives.of(target.lora_name, 1) == buckets
    assert (await e0.engine_state(http))["adapters"][target.lora_name] == snapshot.digest

    # A duplicate that arrives after the attempt is READY is answered from the record.
    late = await resend(http, f"{e0.url}/bucket", publisher.edge.bodies("/bucket")[0])
    assert late.status_code == 200
    assert late.json()["state"] == "RECEIVED"
    assert late.json()["duplicate"] is True
    assert await _collectives(e0, http, target.lora_name) == buckets


@pytest.mark.asyncio
async def test_lost_bucket_reply_is_asked_again_without_a_second_collective(
    sidecars: dict[str, SidecarProcess], http: httpx.AsyncClient, publisher: Publisher
) -> None:
    e1 = sidecars["E1"]
    snapshot = make_snapshot(seed=12)
    target = target_for(snapshot, "lost-bucket-ack")
    buckets = len(plan_for_snapshot(snapshot, BUCKET_BYTES).buckets)
    # Bucket 1 is armed by the sidecar but its ARMED reply never reaches the publisher.
    publisher.edge.lose_reply("/bucket", after=1)

    receipt = await publisher.backend.prepare(e1.engine, target, snapshot)

    assert receipt.attempt == 1
    assert len(publisher.edge.bodies("/bucket")) == buckets + 1
    assert await _collectives(e1, http, target.lora_name) == buckets
    assert publisher.backend.collectives.of(target.lora_name, 1) == buckets
    assert (await e1.engine_state(http))["adapters"][target.lora_name] == snapshot.digest


@pytest.mark.asyncio
async def test_lost_end_reply_returns_the_same_ready_without_a_second_load(
    sidecars: dict[str, SidecarProcess], http: httpx.AsyncClient, publisher: Publisher
) -> None:
    e0 = sidecars["E0"]
    snapshot = make_snapshot(seed=13)
    target = target_for(snapshot, "lost-end-ack")
    publisher.edge.lose_reply("/end")

    receipt = await publisher.backend.prepare(e0.engine, target, snapshot)

    assert receipt.digest == snapshot.digest
    assert len(publisher.edge.bodies("/end")) == 2
    engine = await e0.engine_state(http)
    assert engine["physical_loads"][target.lora_name] == 1
    assert calls_naming(engine, "load", target.lora_name) == 1


@pytest.mark.asyncio
async def test_reentrant_prepare_of_one_attempt_shares_one_driver(
    sidecars: dict[str, SidecarProcess], http: httpx.AsyncClient, publisher: Publisher
) -> None:
    e1 = sidecars["E1"]
    snapshot = make_snapshot(seed=14)
    target = target_for(snapshot, "reentrant")
    buckets = len(plan_for_snapshot(snapshot, BUCKET_BYTES).buckets)

    first, second = await asyncio.gather(
        publisher.backend.prepare(e1.engine, target, snapshot),
        publisher.backend.prepare(e1.engine, target, snapshot),
    )

    assert first == second
    assert len(publisher.edge.bodies("/begin")) == 1
    assert len(publisher.edge.bodies("/bucket")) == buckets
    assert await _collectives(e1, http, target.lora_name) == buckets
    assert (await e1.engine_state(http))["physical_loads"][target.lora_name] == 1


@pytest.mark.asyncio
async def test_a_new_driver_confirms_a_load_whose_reply_was_lost_without_loading_again(
    sidecars: dict[str, SidecarProcess], http: httpx.AsyncClient, publisher: Publisher
) -> None:
    e0 = sidecars["E0"]
    snapshot = make_snapshot(seed=15)
    target = target_for(snapshot, "load-reply-lost")
    # The engine loads, but its answer to the sidecar is lost: the sidecar cannot know.
    await e0.script(http, "load", "lose_reply")

    with pytest.raises(BackendAmbiguousError) as ambiguous:
        await publisher.backend.prepare(e0.engine, target, snapshot)
    assert ambiguous.value.details["reason"] == "ENGINE_UNCERTAIN"
    assert await state_of(e0, http, target.lora_name, 1) == "UNCERTAIN"

    # The publisher prepares the same attempt again: a new driver, no new transfer; the sidecar
    # finds the adapter listed at its directory and confirms it.
    receipt = await publisher.backend.prepare(e0.engine, target, snapshot)

    assert receipt.digest == snapshot.digest
    assert await state_of(e0, http, target.lora_name, 1) == "READY"
    assert (await e0.engine_state(http))["physical_loads"][target.lora_name] == 1
    assert len(publisher.edge.bodies("/begin")) == 2
    assert publisher.backend.collectives.of(target.lora_name, 1) == len(
        plan_for_snapshot(snapshot, BUCKET_BYTES).buckets
    )


@pytest.mark.asyncio
async def test_a_new_driver_restarts_an_attempt_that_failed_cleanly(
    sidecars: dict[str, SidecarProcess], http: httpx.AsyncClient, publisher: Publisher
) -> None:
    e1 = sidecars["E1"]
    snapshot = make_snapshot(seed=16)
    target = target_for(snapshot, "retry-after-refusal")
    buckets = len(plan_for_snapshot(snapshot, BUCKET_BYTES).buckets)
    await e1.script(http, "load", "refuse")

    with pytest.raises(BackendRefusedError):
        await publisher.backend.prepare(e1.engine, target, snapshot)
    # The refused driver's own Begin, repeated, still gets the root cause...
    repeat = await resend(http, e1.url + "/begin", publisher.edge.bodies("/begin")[0])
    assert repeat.json()["reason"] == "ENGINE_REFUSED"
    # ...while a new driver starts the attempt over: nothing of it was held.
    receipt = await publisher.backend.prepare(e1.engine, target, snapshot)

    assert receipt.attempt == 1
    assert (await e1.engine_state(http))["physical_loads"][target.lora_name] == 1
    assert publisher.backend.collectives.of(target.lora_name, 1) == 2 * buckets
