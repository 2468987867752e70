"""What the reclaimer, the resolver and the repairer share as background components.

Each runs rounds (:class:`~agentic_lora.foundation.background.Rounds`) in one task between
``start()`` and ``stop()``; ``async with`` brackets the two, so a component used as a context
manager never leaves its loop running behind the block.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Iterable
from typing import Self

from agentic_lora.foundation.background import Rounds
from agentic_lora.foundation.background import stop_loop

__all__ = ["BackgroundLoop"]


class BackgroundLoop(abc.ABC):
    """One background task running :meth:`_run` between ``start()`` and ``stop()``, as an async
    context manager, and the rounds finished so far."""

    _rounds: Rounds
    _loop_task: asyncio.Task[None] | None = None
    #: The background task's name (in task dumps and asyncio's debug reports).
    _loop_name: str = "agentic-lora background loop"

    @abc.abstractmethod
    async def _run(self) -> None:
        """The loop itself: rounds until cancelled."""

    def _starting(self) -> None:
        """Runs just before a new loop task starts (e.g. to make its first round due at once)."""
        return None

    def _finishing(self) -> Iterable[asyncio.Task[object]]:
        """Work the loop started that ``stop()`` lets finish after the loop ended."""
        return ()

    def start(self) -> None:
        """Run rounds in the background until :meth:`stop` (nothing if already running)."""
        if self._loop_task is None or self._loop_task.done():
            self._starting()
            self._loop_task = asyncio.get_running_loop().create_task(
                self._run(), name=self._loop_name
            )

    async def stop(self) -> None:
        """Stop the background loop; work it started (:meth:`_finishing`) finishes first."""
        task, self._loop_task = self._loop_task, None
        await stop_loop(task, then=self._finishing())

    @property
    def rounds(self) -> int:
        """Rounds the background loop has finished (for observers and tests)."""
        return self._rounds.count

    async def __aenter__(self) -> Self:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
