"""Stopping a component's background loop (the reclaimer's, the repairer's, the resolver's).

A loop is cancelled and awaited until it really ended, so a stopped component never has a round
still running behind its back. Work a round started that must not be abandoned halfway (an unload
or a repair load in flight: cancelling it could leave an engine holding what the registry thinks
is gone) is then awaited to its end; its failure is not raised here, because it was already
reported where it ran.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Iterable
from typing import Any

__all__ = ["stop_loop"]


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
