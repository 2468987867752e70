"""A component's background loop (the reclaimer's, the repairer's, the resolver's): its rounds
and how it stops.

:class:`Rounds` is the I/O-free bookkeeping every such loop shares: a poke asks for a round, a
round clears the poke when it starts (so a poke that arrives during a round triggers another
one, never gets lost), and "settled" means no poke pending and no round running.

A loop is cancelled and awaited until it really ended, so a stopped component never has a round
still running behind its back. Work a round started that must not be abandoned halfway (an unload
or a repair load in flight: cancelling it could leave an engine holding what the registry thinks
is gone) is then awaited to its end; its failure is not raised here, because it was already
reported where it ran.

:func:`backoff` is the one retry-wait strategy (tenacity's ``wait_base``) of the loops that retry
work an engine could not confirm: the resolver's cleanup of a blocked publication and the
reclaimer's unload on an engine that is down. An operator tunes them alike, a test injects one to
step them. Generation requests never come here: they are sent exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from collections.abc import Awaitable
from collections.abc import Callable
from collections.abc import Iterable
from typing import Any

from tenacity import AsyncRetrying
from tenacity import RetryCallState
from tenacity import wait_exponential
from tenacity.wait import wait_base

__all__ = [
    "DEFAULT_BACKOFF_INITIAL",
    "DEFAULT_BACKOFF_MAX",
    "Rounds",
    "backoff",
    "delay_after",
    "stop_loop",
]

#: Seconds before the first retry.
DEFAULT_BACKOFF_INITIAL = 1.0
#: Longest wait between two retries.
DEFAULT_BACKOFF_MAX = 30.0

_RETRYING = AsyncRetrying()


def backoff(
    initial: float = DEFAULT_BACKOFF_INITIAL, cap: float = DEFAULT_BACKOFF_MAX
) -> wait_base:
    """``initial``, twice that, four times ... at most ``cap`` seconds between two rounds."""
    return wait_exponential(multiplier=initial, max=cap)


def delay_after(wait: wait_base, failures: int) -> float:
    """The seconds ``wait`` asks for after ``failures`` failed rounds in a row (``failures`` >= 1)."""
    state = RetryCallState(_RETRYING, None, (), {})
    state.attempt_number = failures
    return float(wait(state))


class Rounds:
    """Pokes, the round running now, and how many rounds finished (see module docstring)."""

    def __init__(self) -> None:
        #: Set by a poke; cleared when the next round starts.
        self.wake = asyncio.Event()
        #: Rounds finished (a round that raised or was cancelled counts).
        self.count = 0
        self._busy = False
        self._idle = asyncio.Condition()

    def poke(self) -> None:
        """Ask for a round."""
        self.wake.set()

    @contextlib.asynccontextmanager
    async def round(self) -> AsyncIterator[None]:
        """The block is one round: settled() waits for it, a poke during it is kept."""
        async with self._idle:
            self.wake.clear()
            self._busy = True
        try:
            yield
        finally:
            async with self._idle:
                self._busy = False
                self.count += 1
                self._idle.notify_all()

    async def wait(self, at_most: float) -> None:
        """Return on a poke (at once if one is pending) or after ``at_most`` seconds.

        Not ``asyncio.wait_for``: on Python 3.11 it swallows a cancellation that lands in the
        loop turn in which the poke woke it, so a loop poked just before its stop never ended.
        """
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(at_most):
                await self.wake.wait()

    async def settled(self, until: Callable[[], bool] = lambda: True) -> None:
        """Return once no poke is pending, no round is running and ``until()`` holds (it is
        checked at the end of every round)."""
        async with self._idle:
            await self._idle.wait_for(lambda: not self.wake.is_set() and not self._busy and until())


async def stop_loop(
    task: asyncio.Task[Any] | None, *, then: Iterable[Awaitable[object]] = ()
) -> None:
    """Cancel ``task`` and wait until it ended; then wait for each of ``then`` to finish."""
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    for work in list(then):
        with contextlib.suppress(Exception):
            await work
