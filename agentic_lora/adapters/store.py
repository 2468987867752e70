"""An immutable on-disk store of adapter directories, one per lora name.

A version's directory is written once and never changed:

1. the snapshot is written into a fresh temporary directory beside the final one (same
   filesystem), together with a marker file naming the lora name, the digest and the manifest;
2. every file and the temporary directory are fsynced (all at once: one journal commit);
3. the temporary directory is renamed to ``<root>/<lora_name>`` (atomic), and the root is fsynced.

So a reader (an engine loading ``lora_path``) sees either no directory or a complete one, never a
half-written adapter, and a crash leaves at worst a ``.tmp-*`` directory that
:meth:`AdapterStore.discard_partials` removes. An existing directory is never overwritten: a second
``put`` of the same name verifies it (marker digest and the content re-hashed from the files) and
returns it, or raises :class:`~agentic_lora.errors.VersionConflictError` when it holds other
content. Removal (on reclaim or cleanup) touches only the exact name, renaming it aside first so
no reader ever sees a partly deleted adapter. :meth:`AdapterStore.move_sync` moves one stored name
into another store on the same filesystem (one rename: the whole directory is in one place or the
other), which is how a backend keeps a reclaimed version's content out of every engine's reach
while a rollback may still need it, and :meth:`AdapterStore.keep_newest_sync` bounds such a store.

Linux ``rename(2)`` replaces an *empty* directory at the target; nothing in this store creates
one, and a non-empty target makes the rename fail, which is then treated as "already there".
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from agentic_lora.adapters.snapshot import CONFIG_FILE
from agentic_lora.adapters.snapshot import WEIGHTS_FILE
from agentic_lora.adapters.snapshot import AdapterSnapshot
from agentic_lora.errors import InvalidAdapterError
from agentic_lora.errors import InvalidIdentityError
from agentic_lora.errors import VersionConflictError
from agentic_lora.foundation.fsync import fsync_path
from agentic_lora.foundation.fsync import fsync_paths

__all__ = ["MARKER_FILE", "AdapterStore"]

logger = logging.getLogger(__name__)

#: Written inside every stored directory; engines ignore it (it is not a weights file).
MARKER_FILE = "agentic_lora_version.json"
_MARKER_FORMAT = 1
_TMP_PREFIX = ".tmp-"
_TRASH_PREFIX = ".trash-"


class AdapterStore:
    """Immutable adapter directories under one absolute ``root`` (created if missing)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        path = Path(root)
        if not path.is_absolute():
            path = Path.cwd() / path
        self.root = Path(os.path.normpath(path))
        self.root.mkdir(parents=True, exist_ok=True)

    def path_for(self, lora_name: str) -> Path:
        """The absolute directory ``lora_name`` is (or would be) stored at."""
        return self.root / _checked_name(lora_name)

    # --- async front (blocking file I/O runs in a worker thread) ----------------------------

    async def put(self, lora_name: str, snapshot: AdapterSnapshot) -> Path:
        """Store ``snapshot`` as ``lora_name`` (or verify the copy already there)."""
        return await asyncio.to_thread(self.put_sync, lora_name, snapshot)

    async def remove(self, lora_name: str) -> bool:
        """Remove exactly ``lora_name``; False if it was not there."""
        return await asyncio.to_thread(self.remove_sync, lora_name)

    async def verify(self, lora_name: str, digest: str) -> Path:
        """The stored path if it holds ``digest``; VERSION_CONFLICT or UNKNOWN otherwise."""
        return await asyncio.to_thread(self.verify_sync, lora_name, digest)

    async def read(self, lora_name: str, digest: str) -> AdapterSnapshot:
        """The stored content of ``lora_name`` as a snapshot, verified like :meth:`verify`."""
        return await asyncio.to_thread(self.read_sync, lora_name, digest)

    # --- sync implementation ------------------------------------------------------------------

    def put_sync(self, lora_name: str, snapshot: AdapterSnapshot) -> Path:
        """Blocking form of :meth:`put`."""
        final = self.path_for(lora_name)
        if final.exists():
            return self.verify_sync(lora_name, snapshot.digest)
        tmp = self.root / f"{_TMP_PREFIX}{lora_name}-{uuid.uuid4().hex}"
        tmp.mkdir()
        try:
            snapshot.write_peft_dir(tmp)
            _write_marker(tmp / MARKER_FILE, lora_name, snapshot)
            # Every file and the names in ``tmp`` are on disk before the rename publishes them.
            fsync_paths([*(tmp / name for name in (CONFIG_FILE, WEIGHTS_FILE, MARKER_FILE)), tmp])
            try:
                os.rename(tmp, final)
            except OSError as exc:
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
                # Someone stored this name between our check and our rename: theirs stands.
                return self.verify_sync(lora_name, snapshot.digest)
            fsync_path(self.root)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        logger.info("stored adapter %s at %s", lora_name, final, extra={"version": lora_name})
        return final

    def verify_sync(self, lora_name: str, digest: str) -> Path:
        """Blocking form of :meth:`verify`."""
        return self._verified(lora_name, digest)[0]

    def read_sync(self, lora_name: str, digest: str) -> AdapterSnapshot:
        """Blocking form of :meth:`read` (the files are read and hashed once)."""
        return self._verified(lora_name, digest)[1]

    def _verified(self, lora_name: str, digest: str) -> tuple[Path, AdapterSnapshot]:
        final = self.path_for(lora_name)
        if not final.is_dir():
            raise _conflict(
                final, digest, f"{final} is not a stored adapter directory", reason="missing"
            )
        marker = _read_marker(final / MARKER_FILE)
        found = marker.get("digest") if marker is not None else None
        if marker is None or found != digest or marker.get("lora_name") != lora_name:
            raise _conflict(
                final,
                digest,
                f"{final} holds other content than {lora_name} ({digest[:16]})",
                reason="marker_mismatch",
                found_digest=found,
            )
        try:
            snapshot = AdapterSnapshot.from_peft_dir(final)
        except InvalidAdapterError as exc:
            raise _conflict(
                final,
                digest,
                f"{final} does not hold a readable adapter: {exc.message}",
                reason="unreadable",
            ) from exc
        if snapshot.digest != digest:
            raise _conflict(
                final,
                digest,
                f"{final} files hash to {snapshot.digest[:16]}, its marker says {digest[:16]}",
                reason="content_mismatch",
                found_digest=snapshot.digest,
            )
        return final, snapshot

    def remove_sync(self, lora_name: str) -> bool:
        """Blocking form of :meth:`remove`."""
        final = self.path_for(lora_name)
        if not final.exists():
            return False
        trash = self.root / f"{_TRASH_PREFIX}{lora_name}-{uuid.uuid4().hex}"
        # Rename first: a reader sees the whole directory or none of it, never a partial one.
        os.rename(final, trash)
        fsync_path(self.root)
        shutil.rmtree(trash, ignore_errors=True)
        logger.info("removed stored adapter %s", lora_name, extra={"version": lora_name})
        return True

    def move_sync(self, lora_name: str, into: AdapterStore) -> bool:
        """Move exactly ``lora_name`` into ``into`` (on the same filesystem), dated now there.

        If ``into`` holds the name already (it is immutable: the same content), the copy here is
        removed instead and the one there is dated now. False if the name was not here.
        """
        final = self.path_for(lora_name)
        if not final.exists():
            return False
        target = into.path_for(lora_name)
        if not target.exists():
            try:
                os.rename(final, target)
            except OSError as exc:
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
                # Another copy got there first (another engine's): it stands, this one goes.
            else:
                fsync_path(self.root)
                fsync_path(into.root)
                os.utime(target)  # the rename keeps the old times: date it for keep_newest_sync
                logger.info("moved stored adapter %s to %s", lora_name, into.root)
                return True
        os.utime(target)
        return self.remove_sync(lora_name)

    def keep_newest_sync(self, keep: int) -> int:
        """Remove every stored name but the ``keep`` newest (by modification time: when it was
        stored, or moved here); returns how many were removed."""
        stored = sorted(
            (self.path_for(name) for name in self.names()),
            key=lambda path: path.stat().st_mtime,
            reverse=True,
        )
        for path in stored[keep:]:
            self.remove_sync(path.name)
        return len(stored[keep:])

    def discard_partials(self) -> int:
        """Delete leftovers of interrupted writes and removals; returns how many."""
        count = 0
        for child in self.root.iterdir():
            if child.name.startswith((_TMP_PREFIX, _TRASH_PREFIX)) and child.is_dir():
                shutil.rmtree(child, ignore_errors=True)
                count += 1
        return count

    def names(self) -> list[str]:
        """Stored lora names, sorted."""
        return sorted(
            c.name
            for c in self.root.iterdir()
            if c.is_dir() and not c.name.startswith((_TMP_PREFIX, _TRASH_PREFIX))
        )


def _checked_name(lora_name: str) -> str:
    if (
        not isinstance(lora_name, str)
        or not lora_name
        or len(lora_name.encode()) > 255
        or lora_name in (".", "..")
        or "/" in lora_name
        or "\\" in lora_name
        or "\x00" in lora_name
        or lora_name.startswith(".")
    ):
        raise InvalidIdentityError(
            f"{lora_name!r} cannot name a stored adapter directory",
            field="lora_name",
            lora_name=lora_name,
        )
    return lora_name


def _write_marker(path: Path, lora_name: str, snapshot: AdapterSnapshot) -> None:
    marker = {
        "format": _MARKER_FORMAT,
        "lora_name": lora_name,
        "digest": snapshot.digest,
        "manifest": snapshot.manifest.to_dict(),
    }
    path.write_text(json.dumps(marker, sort_keys=True, indent=1))


def _read_marker(path: Path) -> dict[str, Any] | None:
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict) or raw.get("format") != _MARKER_FORMAT:
        return None
    return raw


def _conflict(
    final: Path, digest: str, message: str, *, reason: str, **details: Any
) -> VersionConflictError:
    """``final`` does not hold the version ``digest`` names (its lora name is the directory's)."""
    return VersionConflictError(
        message,
        lora_name=final.name,
        path=str(final),
        expected_digest=digest,
        reason=reason,
        **details,
    )
