"""Where a repair gets a version's content: a :class:`SnapshotSource`, usually the Deployment's
:class:`SnapshotCache` over what this process published, falling back to a backend's immutable
store (see :mod:`agentic_lora.publication.repair`)."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Awaitable
from collections.abc import Callable
from collections.abc import Iterator
from typing import Protocol
from typing import runtime_checkable

from agentic_lora.adapters.snapshot import AdapterSnapshot
from agentic_lora.errors import BackendRefusedError
from agentic_lora.registry.types import RegistryStatus
from agentic_lora.registry.types import VersionState
from agentic_lora.registry.types import VersionStatus

__all__ = ["SnapshotCache", "SnapshotSource", "StoredSnapshot"]


@runtime_checkable
class SnapshotSource(Protocol):
    """The content of a version, for loading it onto an engine again."""

    async def snapshot(self, version: VersionStatus) -> AdapterSnapshot:
        """``version``'s content (its digest is ``version.digest``); raise if it cannot be had."""
        ...


StoredSnapshot = Callable[[str, str], Awaitable[AdapterSnapshot | None]]
"""``await stored(lora_name, digest)``: the content a backend's immutable store holds under
``lora_name``, verified to hash to ``digest``, or None (e.g.
:meth:`~agentic_lora.engines.adapter_backend.AdapterDirectoryBackend.stored_snapshot`)."""


class SnapshotCache:
    """A :class:`SnapshotSource` over the snapshots this process published, plus a fallback.

    An entry serves only a version with its digest, so content published under a conflicting id
    is never served for another version. :meth:`publishing` keeps an entry while its publication
    runs; :meth:`prune` (called by the repairer with every status it reads) drops entries whose
    version is RECLAIMED or FAILED_CLEAN, was never reserved, or names other content. Misses go
    to ``stored`` (a backend's immutable store), which is how a restarted publisher repairs.
    """

    def __init__(self, *, stored: StoredSnapshot | None = None) -> None:
        self._stored = stored
        self._entries: dict[str, AdapterSnapshot] = {}
        self._publishing: Counter[str] = Counter()
        # When each entry was last put or left its publication, on a counter (see prune).
        self._seq = 0
        self._touched: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, version_id: object) -> bool:
        return version_id in self._entries

    def put(self, version_id: str, snapshot: AdapterSnapshot) -> None:
        """Keep ``snapshot`` as ``version_id``'s content."""
        self._entries[version_id] = snapshot
        self._touch(version_id)

    def evict(self, version_id: str) -> bool:
        """Forget ``version_id`` (False if it was not cached)."""
        self._touched.pop(version_id, None)
        return self._entries.pop(version_id, None) is not None

    def mark(self) -> int:
        """A point to pass to :meth:`prune` as ``since``: take it before reading the status."""
        return self._seq

    def _touch(self, version_id: str) -> None:
        self._seq += 1
        self._touched[version_id] = self._seq

    @contextlib.contextmanager
    def publishing(self, version_id: str, snapshot: AdapterSnapshot) -> Iterator[None]:
        """Cache ``snapshot`` before its publication starts; :meth:`prune` spares it meanwhile.

        Put first: a restart observed right after the commit can be repaired at once.
        """
        self.put(version_id, snapshot)
        self._publishing[version_id] += 1
        try:
            yield
        finally:
            self._publishing[version_id] -= 1
            if self._publishing[version_id] <= 0:
                del self._publishing[version_id]
            if version_id in self._entries:
                self._touch(version_id)

    def prune(self, status: RegistryStatus, *, since: int | None = None) -> int:
        """Drop entries no repair can need any more (see class docstring); returns how many.

        ``since`` (a :meth:`mark` taken before ``status`` was read) spares every entry put, or
        whose publication ended, after it: the status may predate that publication's reserve.
        """
        known = {v.version_id: v for v in status.versions}
        drop = []
        for version_id, snapshot in self._entries.items():
            if version_id in self._publishing:
                continue
            if since is not None and self._touched.get(version_id, 0) > since:
                continue
            v = known.get(version_id)
            if (
                v is None
                or v.digest != snapshot.digest
                or v.state in (VersionState.RECLAIMED, VersionState.FAILED_CLEAN)
            ):
                drop.append(version_id)
        for version_id in drop:
            self.evict(version_id)
        return len(drop)

    async def snapshot(self, version: VersionStatus) -> AdapterSnapshot:
        """The cached content, else the stored one; BackendRefusedError if neither exists."""
        cached = self._entries.get(version.version_id)
        if cached is not None and cached.digest == version.digest:
            return cached
        if self._stored is not None:
            stored = await self._stored(version.lora_name, version.digest)
            if stored is not None:
                if stored.digest != version.digest:
                    raise BackendRefusedError(
                        f"the stored copy of {version.lora_name} hashes to {stored.digest[:16]}, "
                        f"not {version.digest[:16]}",
                        version=version.version_id,
                        reason="snapshot_mismatch",
                    )
                return stored
        raise BackendRefusedError(
            f"the content of {version.version_id} ({version.lora_name}) is neither cached nor "
            "stored; it cannot be loaded onto an engine again",
            version=version.version_id,
            reason="snapshot_unavailable",
        )
