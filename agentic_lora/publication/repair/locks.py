"""The lock repair and reclaim share: one asyncio lock per version id (see
:mod:`agentic_lora.publication.repair` for why a repair and a reclaim of the same version never overlap)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

__all__ = ["VersionLocks"]


class VersionLocks:
    """One asyncio lock per version id, shared by the :class:`Repairer` and the Reclaimer.

    A lock exists only while someone holds or waits for it, so memory follows the versions in
    use, not every version ever seen.
    """

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    def locked(self, version_id: str) -> bool:
        """Whether someone holds ``version_id``'s lock now."""
        entry = self._locks.get(version_id)
        return entry is not None and entry[0].locked()

    def contenders(self, version_id: str) -> int:
        """How many hold or wait for ``version_id``'s lock now."""
        entry = self._locks.get(version_id)
        return 0 if entry is None else entry[1]

    @contextlib.asynccontextmanager
    async def hold(self, version_id: str) -> AsyncIterator[None]:
        """Hold ``version_id``'s lock for the duration of the block."""
        lock, users = self._locks.get(version_id) or (asyncio.Lock(), 0)
        self._locks[version_id] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[version_id]
            if users == 1:
                del self._locks[version_id]
            else:
                self._locks[version_id] = (lock, users - 1)
