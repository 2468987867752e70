"""Background loops: a poke during a round is kept, settled() waits for the round, stop finishes
the work a round started."""

from __future__ import annotations

import asyncio

import pytest

from agentic_lora.foundation.background import Rounds, stop_loop

pytestmark = pytest.mark.asyncio


async def test_a_poke_during_a_round_is_kept_and_settled_waits_for_the_round() -> None:
    rounds = Rounds()
    inside, leave = asyncio.Event(), asyncio.Event()

    async def one_round() -> None:
        async with rounds.round():
            inside.set()
            await leave.wait()

    rounds.poke()
    task = asyncio.create_task(one_round())
    await inside.wait()
    assert not rounds.wake.is_set()  # cleared when the round started
    rounds.poke()  # arrives during the round
    settled = asyncio.create_task(rounds.settled())
    leave.set()
    await task
    assert rounds.count == 1
    assert rounds.wake.is_set()  # kept for the next round
    assert not settled.done()
    inside.clear()
    second = asyncio.create_task(one_round())
    await second
    await settled
    assert rounds.count == 2


async def test_stop_loop_cancels_the_loop_then_lets_started_work_finish() -> None:
    finish = asyncio.Event()
    loop = asyncio.create_task(asyncio.Event().wait())

    async def work() -> str:
        await finish.wait()
        return "done"

    async def broken() -> None:
        raise RuntimeError("reported where it ran")

    started = [asyncio.create_task(work()), asyncio.create_task(broken())]
    stopping = asyncio.create_task(stop_loop(loop, then=started))
    await asyncio.wait({loop})
    assert loop.cancelled()
    assert not stopping.done()
    finish.set()
    await stopping  # the broken one's error is not raised here
    assert started[0].result() == "done"
    await stop_loop(None)  # nothing running: nothing to do
