"""Messages that race a running load: gated at the engine, so the load is provably in flight."""

from __future__ import annotations

import asyncio

import pytest

from tests.dcs.conftest import Cases
from tests.dcs.conftest import Publisher
from tests.dcs.util import BUCKET_BYTES

pytestmark = [pytest.mark.dcs, pytest.mark.asyncio, pytest.mark.timeout(60)]


async def test_a_cleanup_sent_during_the_load_waits_for_it_and_leaves_nothing_behind(
    cases: Cases, publisher: Publisher
) -> None:
    case = cases("E0", seed=101, version_id="cleanup-during-load")
    loads = await case.calls("load")
    await case.gate("load", "cleanup-during-load")

    prepare = asyncio.create_task(publisher.prepare(case))
    await case.wait_for_calls("load", loads + 1)  # the load is at the engine, held
    cleanup = asyncio.create_task(publisher.cleanup(case))
    await case.open_gate("cleanup-during-load")
    receipt = await prepare
    await cleanup

    # The load finished first (the prepare saw READY); the cleanup then unloaded it, once.
    assert receipt.lora_name == case.name
    assert await case.served() is None
    assert (await case.loads(), await case.unloads()) == (1, 1)
    assert await case.state() == "CLEANED"
    assert not case.stored()


async def test_a_second_driver_during_the_load_joins_it_instead_of_loading_again(
    cases: Cases,
) -> None:
    case = cases("E1", seed=102, version_id="second-driver-during-load")
    loads = await case.calls("load")
    await case.gate("load", "second-driver")
    # Two publisher processes (two backends) prepare the same attempt.
    sidecars = {"E1": case.sidecar}
    first, second = Publisher(sidecars, BUCKET_BYTES), Publisher(sidecars, BUCKET_BYTES)
    try:
        one = asyncio.create_task(first.prepare(case))
        await case.wait_for_calls("load", loads + 1)
        infos = await case.calls("server_info")
        two = asyncio.create_task(second.prepare(case))
        # Its incarnation read and its Begin each ask the engine once; the load is still held.
        await case.wait_for_calls("server_info", infos + 2)
        view = await case.view()
        assert view is not None
        assert (view["state"], view["drivers"]) == ("LOADING", 2)
        await case.open_gate("second-driver")
        receipts = await asyncio.gather(one, two)
    finally:
        await first.aclose()
        await second.aclose()

    assert receipts[0] == receipts[1]
    assert await case.loads() == 1
    assert second.edge.bodies("/bucket") == []
