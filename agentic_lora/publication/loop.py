"""What the reclaimer, the resolver and the repairer share as background components.

Each runs rounds (:class:`~agentic_lora.foundation.background.Rounds`) in one task between
``start()`` and ``stop()``; ``async with`` brackets the two, so a component used as a context
manager never leaves its loop running behind the block.
"""

from __future__ import annotations

import abc
from typing import Self

from agentic_lora.foundation.background import Rounds

__all__ = ["BackgroundLoop"]


class BackgroundLoop(abc.ABC):
    """``start()``/``stop()`` as an async context manager, and the rounds finished so far."""

    _rounds: Rounds

    @abc.abstractmethod
    def start(self) -> None:
        """Start the loop's task (idempotent)."""

    @abc.abstractmethod
    async def stop(self) -> None:
        """Stop the loop and wait for its task to end."""

    @property
    def rounds(self) -> int:
        """Rounds the background loop has finished (for observers and tests)."""
        return self._rounds.count

    async def __aenter__(self) -> Self:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
