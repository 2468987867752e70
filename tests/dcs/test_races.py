"""Messages that race a running load: gated at the engine, so the load is provably in flight."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.dcs.conftest import Publisher
from tests.dcs.util import (
    SidecarProcess,
    gate,
    make_snapshot,
    open_gate,
    state_of,
    target_for,
    wait_for_calls,
)

pytestmark = [pytest.mark.dcs, pytest.mark.timeout(60)]


async def _count(sidecar: SidecarProcess, http: httpx.AsyncClient, op: str) -> int:
    calls = (await sidecar.engine_state(http))["calls"]
    return sum(1 for name, _ in calls if name == op)


@pytest.mark.asyncio
async def test_a_cleanup_sent_during_the_load_waits_for_it_and_leaves_nothing_behind(
    sidecars: dict[str, SidecarProcess], http: httpx.AsyncClient, publisher: Publisher
) -> None:
    e0 = sidecars["E0"]
    snapshot = make_snapshot(seed=101)
    target = target_for(snapshot, "cleanup-during-load")
    loads = await _count(e0, http, "load")
    await gate(e0, http, "load", "cleanup-during-load")

    prepare = asyncio.create_task(publisher.backend.prepare(e0.engine, target, snapshot))
    await wait_for_calls(e0, http, "load", loads + 1)  # the load is at the engine, held
    cleanup = asyncio.create_task(publisher.backend.cleanup(e0.engine, target))
    await open_gate(e0, http, "cleanup-during-load")
    receipt = await prepare
    await cleanup

    # The load finished first (the prepare saw READY); the cleanup then unloaded it, once.
    assert receipt.lora_name == target.lora_name
    engine = await e0.engine_state(http)
    assert target.lora_name not in engine["adapters"]
    assert engine["physical_loads"][target.lora_name] == 1
    assert engine["physical_unloads"][target.lora_name] == 1
    assert await state_of(e0, http, target.lora_name, 1) == "CLEANED"
    assert not (e0.store_dir / target.lora_name).exists()


@pytest.mark.asyncio
async def test_a_second_driver_during_the_load_joins_it_instead_of_loading_again(
    sidecars: dict[str, SidecarProcess], http: httpx.AsyncClient
) -> None:
    e1 = sidecars["E1"]
    snapshot = make_snapshot(seed=102)
    target = target_for(snapshot, "second-driver-during-load")
    loads = await _count(e1, http, "load")
    await gate(e1, http, "load", "second-driver")
    # Two publisher processes (two backends) prepare the same attempt.
    first, second = Publisher({"E1": e1}, 4096), Publisher({"E1": e1}, 4096)
    try:
        one = asyncio.create_task(first.backend.prepare(e1.engine, target, snapshot))
        await wait_for_calls(e1, http, "load", loads + 1)
        infos = await _count(e1, http, "server_info")
        two = asyncio.create_task(second.backend.prepare(e1.engine, target, snapshot))
        # Its incarnation read and its Begin each ask the engine once; the load is still held.
        await wait_for_calls(e1, http, "server_info", infos + 2)
        view = await e1.attempt(http, target.lora_name, 1)
        assert view is not None
        assert (view["state"], view["drivers"]) == ("LOADING", 2)
        await open_gate(e1, http, "second-driver")
        receipts = await asyncio.gather(one, two)
    finally:
        await first.aclose()
        await second.aclose()

    assert receipts[0] == receipts[1]
    assert (await e1.engine_state(http))["physical_loads"][target.lora_name] == 1
    assert second.edge.bodies("/bucket") == []
