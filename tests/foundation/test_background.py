"""Background loops: a poke during a round is kept, settled() waits for the round, stop finishes
the work a round started."""

from __future__ import annotations

import asyncio

import pytest

from agentic_lora.foundation.background import Rounds
from agentic_lora.foundation.background import stop_loop

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


@pytest.mark.asyncio
async def test_a_stop_in_the_loop_turn_of_a_poke_still_ends_the_wait() -> None:
    rounds = Rounds()
    waiting = asyncio.Event()

    async def loop() -> None:
        while True:
            waiting.set()  # no await from here into the wait below
            await rounds.wait(3600.0)
            waiting.clear()

    task = asyncio.create_task(loop())
    await waiting.wait()
    rounds.poke()  # wakes the wait ...
    await stop_loop(task)  # ... and is cancelled in the same turn: the loop still ends
    assert task.cancelled()


@pytest.mark.asyncio
async def test_a_wait_returns_at_once_on_a_pending_poke_and_after_its_time_without_one() -> None:
    rounds = Rounds()
    rounds.poke()
    await rounds.wait(3600.0)  # pending: no wait at all
    rounds.wake.clear()
    await rounds.wait(0.0)  # nothing pending: its time is up at once
    assert not rounds.wake.is_set()
