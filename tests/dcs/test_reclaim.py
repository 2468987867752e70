"""Reclaim goes through the sidecar: one physical unload per engine, and the name stays gone."""

from __future__ import annotations

import httpx
import pytest

from agentic_lora.errors import BackendAmbiguousError
from tests.dcs.conftest import Publisher
from tests.dcs.util import SidecarProcess, calls_naming, make_snapshot, resend, target_for

pytestmark = [pytest.mark.dcs, pytest.mark.timeout(60)]


@pytest.mark.asyncio
async def test_reclaim_unloads_once_and_fences_the_name_for_good(
    sidecars: dict[str, SidecarProcess], http: httpx.AsyncClient, publisher: Publisher
) -> None:
    e0 = sidecars["E0"]
    snapshot = make_snapshot(seed=51)
    target = target_for(snapshot, "reclaim-once")
    await publisher.backend.prepare(e0.engine, target, snapshot)
    old_begin = publisher.edge.bodies("/begin")[0]

    await publisher.backend.reclaim(e0.engine, lora_name=target.lora_name, reclaim_id="r-1")
    await publisher.backend.reclaim(e0.engine, lora_name=target.lora_name, reclaim_id="r-1")

    engine = await e0.engine_state(http)
    assert engine["physical_unloads"][target.lora_name] == 1
    assert target.lora_name not in engine["adapters"]
    assert not (e0.store_dir / target.lora_name).exists()
    assert target.lora_name in (await e0.status(http))["reclaimed"]
    # A late Begin for a reclaimed name never loads it again.
    late = await resend(http, e0.url + "/begin", old_begin)
    assert late.status_code == 409
    assert late.json()["reason"] == "RECLAIMED"
    assert (await e0.engine_state(http))["physical_loads"][target.lora_name] == 1


@pytest.mark.asyncio
async def test_a_lost_reclaim_reply_is_retried_without_a_second_physical_unload(
    sidecars: dict[str, SidecarProcess], http: httpx.AsyncClient, publisher: Publisher
) -> None:
    e1 = sidecars["E1"]
    snapshot = make_snapshot(seed=52)
    target = target_for(snapshot, "reclaim-lost-ack")
    await publisher.backend.prepare(e1.engine, target, snapshot)
    publisher.edge.lose_reply("/reclaim")

    with pytest.raises(BackendAmbiguousError):
        await publisher.backend.reclaim(e1.engine, lora_name=target.lora_name, reclaim_id="r-2")
    await publisher.backend.reclaim(e1.engine, lora_name=target.lora_name, reclaim_id="r-2")

    assert len(publisher.edge.bodies("/reclaim")) == 2
    engine = await e1.engine_state(http)
    assert engine["physical_unloads"][target.lora_name] == 1
    assert calls_naming(engine, "unload", target.lora_name) == 1


@pytest.mark.asyncio
async def test_reclaim_of_a_name_the_engine_does_not_hold_is_confirmed_as_absent(
    sidecars: dict[str, SidecarProcess], http: httpx.AsyncClient, publisher: Publisher
) -> None:
    e0 = sidecars["E0"]
    target = target_for(make_snapshot(seed=53), "reclaim-absent")

    await publisher.backend.reclaim(e0.engine, lora_name=target.lora_name, reclaim_id="r-3")

    engine = await e0.engine_state(http)
    assert target.lora_name not in engine["physical_unloads"]
    assert target.lora_name in (await e0.status(http))["reclaimed"]
