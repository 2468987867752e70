"""Reclaim goes through the sidecar: one physical unload per engine, and the name stays gone."""

from __future__ import annotations

import pytest

from agentic_lora.errors import BackendAmbiguousError
from tests.dcs.conftest import Cases
from tests.dcs.conftest import Publisher

pytestmark = [pytest.mark.dcs, pytest.mark.asyncio, pytest.mark.timeout(60)]


async def test_reclaim_unloads_once_and_fences_the_name_for_good(
    cases: Cases, publisher: Publisher
) -> None:
    case = cases("E0", seed=51, version_id="reclaim-once")
    await publisher.prepare(case)
    old_begin = publisher.edge.bodies("/begin")[0]

    await publisher.reclaim(case, "r-1")
    await publisher.reclaim(case, "r-1")

    assert await case.unloads() == 1
    assert await case.served() is None
    assert not case.stored()
    assert await case.reclaimed()
    # A late Begin for a reclaimed name never loads it again.
    late = await case.resend("/begin", old_begin)
    assert late.status_code == 409
    assert late.json()["reason"] == "RECLAIMED"
    assert await case.loads() == 1


async def test_a_lost_reclaim_reply_is_retried_without_a_second_physical_unload(
    cases: Cases, publisher: Publisher
) -> None:
    case = cases("E1", seed=52, version_id="reclaim-lost-ack")
    await publisher.prepare(case)
    publisher.edge.lose_reply("/reclaim")

    with pytest.raises(BackendAmbiguousError):
        await publisher.reclaim(case, "r-2")
    await publisher.reclaim(case, "r-2")

    assert len(publisher.edge.bodies("/reclaim")) == 2
    assert await case.unloads() == 1
    assert await case.named_calls("unload") == 1


async def test_reclaim_of_a_name_the_engine_does_not_hold_is_confirmed_as_absent(
    cases: Cases, publisher: Publisher
) -> None:
    case = cases("E0", seed=53, version_id="reclaim-absent")

    await publisher.reclaim(case, "r-3")

    assert await case.unloads() == 0
    assert await case.reclaimed()
