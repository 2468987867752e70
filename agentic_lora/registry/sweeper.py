"""The registry host's expiry sweeper: one background task that sweeps every ``interval``.

Expiry belongs to the registry host, not to one owner's lease keeper: the host sweeps every lease
and name tombstone its registry holds (replayed from a journal or opened since, by any caller),
whether or not its own process ever opens a lease. A round only asks; the registry journals a
sweep only when one is due, so an idle registry writes nothing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from collections.abc import Callable

from agentic_lora.errors import JournalError

__all__ = ["Sweeper"]

logger = logging.getLogger(__name__)


class Sweeper:
    """Calls ``sweep_if_due`` every ``interval`` seconds (None: never) once :meth:`ensure` ran,
    until :meth:`stop`, or until the registry refuses with a
    :class:`~agentic_lora.errors.JournalError` (closed or fail-stopped: nothing more to decide).
    ``sleep`` is what it waits with between rounds (tests gate it)."""

    def __init__(
        self,
        sweep_if_due: Callable[[], Awaitable[object]],
        *,
        interval: float | None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        if interval is not None and not interval > 0:
            raise ValueError("sweep_interval must be above 0 (or None: sweep only on request)")
        self.interval = interval
        self._sweep_if_due = sweep_if_due
        self._sleep = sleep
        self._task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        """Whether the background task runs."""
        return self._task is not None and not self._task.done()

    @property
    def started(self) -> bool:
        """Whether :meth:`ensure` ever started it (it may have ended since)."""
        return self._task is not None

    def ensure(self) -> None:
        """Start the background task unless it runs (or no interval is set); on the running loop."""
        if self.interval is None or self.running:
            return
        self._task = asyncio.get_running_loop().create_task(
            self._run(self.interval), name="lora-registry-lease-sweeper"
        )

    def stop(self) -> None:
        """Cancel the background task (a sweep is a registry call: refused once it closed)."""
        if self._task is not None:
            self._task.cancel()

    async def _run(self, interval: float) -> None:
        while True:
            await self._sleep(interval)
            try:
                await self._sweep_if_due()
            except JournalError:
                return
            except Exception:
                logger.exception("lease sweep failed; retried next interval")
