"""The skeleton of a backend that publishes by writing a directory and asking the engine to load it.

Per engine:

* ``prepare``: write the snapshot into this engine's immutable store directory (verified if it is
  already there), read the engine's incarnation, load ``lora_name`` from that directory unless the
  engine already lists exactly that name at exactly that path, then probe one token through the
  exact name. Only then is a READY receipt returned, carrying the incarnation read *before* the
  load, so a restart after it can never hide behind the receipt.
* ``cleanup``: unload the name, then remove its store directory, so a late request that would
  make the engine re-read the path finds nothing to load. "Does not exist" means absent:
  confirmed.
* ``reclaim``: the same unload, once per reclaim id, after an engine-specific wait
  (:meth:`AdapterDirectoryBackend._before_reclaim_unload`) where the engine's own unload does not
  wait for in-flight requests; its store directory is moved out of the engine's reach into
  ``<store_root>/.reclaimed`` (the newest ``keep_reclaimed`` versions are kept there), so a
  rollback can load the version again (:meth:`AdapterDirectoryBackend.stored_snapshot` reads it).

Classification follows :mod:`agentic_lora.engines.backends`: a prepare the engine provably did not act on
is :class:`~agentic_lora.errors.BackendRefusedError`; anything that may have left the adapter
loaded is :class:`~agentic_lora.errors.BackendAmbiguousError`. An unload that did not succeed is
always ambiguous (the adapter may still be there); only UNLOADED or ABSENT confirm it.

Calls for one name on one engine are serialized, and attempt fences
(:mod:`agentic_lora.engines.adapter_backend.fences`) stop a cleanup that overtook its prepare, or a stale
cleanup of a superseded attempt, from recreating or removing anything.

A subclass supplies the engine's admin client and four hooks: the restart fingerprint, the load,
the probe and (optionally) the wait before a reclaim's unload.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import os
import re
from collections.abc import Awaitable
from collections.abc import Callable
from pathlib import Path
from typing import Generic
from typing import Protocol
from typing import TypeVar

import httpx

from agentic_lora.adapters.snapshot import AdapterSnapshot
from agentic_lora.adapters.store import AdapterStore
from agentic_lora.engines.adapter_backend.fences import AttemptFences
from agentic_lora.engines.adapter_backend.fences import Verdict
from agentic_lora.engines.adapter_backend.incarnation import IncarnationTracker
from agentic_lora.engines.admin import AdminTimeouts
from agentic_lora.engines.admin import UnloadOutcome
from agentic_lora.engines.backends import EngineRef
from agentic_lora.engines.backends import PublicationTarget
from agentic_lora.engines.backends import target_ambiguous
from agentic_lora.engines.backends import target_refused
from agentic_lora.errors import BackendAmbiguousError
from agentic_lora.errors import BackendError
from agentic_lora.errors import ConfigurationError
from agentic_lora.errors import VersionConflictError
from agentic_lora.foundation.http_limits import engine_limits
from agentic_lora.registry.types import ReadyReceipt

__all__ = [
    "DEFAULT_KEEP_RECLAIMED",
    "RECLAIMED_DIR",
    "AdapterAdmin",
    "AdapterDirectoryBackend",
    "DrainHook",
]

logger = logging.getLogger(__name__)

DrainHook = Callable[[str], Awaitable[None]]
"""``await wait_drained(lora_name)`` returns once no request using ``lora_name`` is in flight.

What a backend for an engine whose unload does not wait for in-flight requests (vLLM) awaits in
:meth:`AdapterDirectoryBackend._before_reclaim_unload`; the Session middleware's is
:meth:`agentic_lora.session.Versioning.wait_drained`.
"""

_ENGINE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
#: Where reclaimed versions' directories go, under ``store_root`` (no engine name starts with a
#: dot, so no engine is ever given a path in it).
RECLAIMED_DIR = ".reclaimed"
#: How many reclaimed versions the store keeps for a rollback, by default.
DEFAULT_KEEP_RECLAIMED = 8


class AdapterAdmin(Protocol):
    """What the skeleton needs from an engine's admin client (one HTTP attempt per call)."""

    base_url: str

    async def list_lora_adapters(self) -> dict[str, str]:
        """Registered adapters as ``{name: path}``."""
        ...

    async def unload_lora_adapter(self, lora_name: str) -> UnloadOutcome:
        """Unload ``lora_name``: UNLOADED, ABSENT, or a typed error."""
        ...

    async def aclose(self) -> None:
        """Close the client's own HTTP client, if it made one."""
        ...


AdminT = TypeVar("AdminT", bound=AdapterAdmin)


class AdapterDirectoryBackend(abc.ABC, Generic[AdminT]):
    """A :class:`~agentic_lora.engines.backends.Backend` over an immutable store and an admin HTTP API.

    ``store_root`` is an absolute directory the engines can read (each engine gets
    ``<store_root>/<engine name>/<lora name>``). ``client`` may be shared; otherwise one is created
    and closed by :meth:`aclose`. ``keep_reclaimed`` (default 8; 0: none) is how many reclaimed
    versions' content the store keeps for a rollback, newest first.
    """

    def __init__(
        self,
        store_root: str | os.PathLike[str],
        *,
        timeouts: AdminTimeouts | None = None,
        client: httpx.AsyncClient | None = None,
        keep_reclaimed: int = DEFAULT_KEEP_RECLAIMED,
    ) -> None:
        root = Path(store_root)
        if not root.is_absolute():
            raise ConfigurationError(
                f"store_root must be an absolute path the engines can read: {root}",
                store_root=str(root),
            )
        if (
            isinstance(keep_reclaimed, bool)
            or not isinstance(keep_reclaimed, int)
            or keep_reclaimed < 0
        ):
            raise ConfigurationError(
                f"keep_reclaimed must be a whole number of versions, 0 or more: {keep_reclaimed!r}",
                check="keep_reclaimed",
            )
        self.store_root = root
        self.keep_reclaimed = keep_reclaimed
        self._reclaimed_store_lock = asyncio.Lock()
        self.timeouts = timeouts or AdminTimeouts()
        self._owns_client = client is None
        self._client = client or httpx.AsyncClient(
            timeout=httpx.Timeout(self.timeouts.read, connect=self.timeouts.connect),
            limits=engine_limits(),
            trust_env=False,  # no environment proxy between the control plane and an engine
            follow_redirects=False,
        )
        self._admins: dict[str, AdminT] = {}
        self._stores: dict[str, AdapterStore] = {}
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        self._fences = AttemptFences()
        self._incarnations = IncarnationTracker()
        self._reclaimed: set[tuple[str, str]] = set()

    # --- engine-specific hooks ----------------------------------------------------------------

    @abc.abstractmethod
    def _new_admin(self, engine: EngineRef) -> AdminT:
        """An admin client for ``engine`` on the shared HTTP client."""

    @abc.abstractmethod
    async def _fingerprint(self, engine: EngineRef, admin: AdminT) -> str:
        """The engine process's restart witness (read before the adapter listing)."""

    @abc.abstractmethod
    async def _load(
        self, engine: EngineRef, admin: AdminT, target: PublicationTarget, path: Path
    ) -> None:
        """Load ``target.lora_name`` from ``path``; return only once the engine confirmed it."""

    @abc.abstractmethod
    async def _probe(self, admin: AdminT, lora_name: str) -> None:
        """Generate one token through exactly ``lora_name``; a BackendError if it does not serve."""

    async def _before_reclaim_unload(self, engine: EngineRef, lora_name: str) -> None:
        """Runs inside the reclaim, before the unload (the name is already fenced).

        Nothing by default: an engine whose unload waits for its own request refcount needs no
        more. An error here leaves the reclaim unconfirmed and nothing unloaded.
        """
        return None

    # --- Backend ----------------------------------------------------------------------------

    async def incarnation(self, engine: EngineRef) -> str:
        """``<fingerprint>.<generation>`` (see :mod:`agentic_lora.engines.adapter_backend.incarnation`).

        Always reads the fingerprint: this read is also the repairer's health probe, and SGLang
        answers ``/server_info`` from its scheduler, so a hung scheduler fails it, while the
        adapter listing is answered without the scheduler.
        """
        incarnation, _ = await self._full_read(engine, self._admin(engine))
        return incarnation

    async def _full_read(self, engine: EngineRef, admin: AdminT) -> tuple[str, dict[str, str]]:
        """The fingerprint, then the listing (a restart between them shows in the listing)."""
        fingerprint = await self._fingerprint(engine, admin)
        listed = await admin.list_lora_adapters()
        return self._incarnations.observe(engine.name, fingerprint, listed), listed

    async def recheck_incarnation(self, engine: EngineRef) -> str:
        """The incarnation for a restart check alone (see
        :class:`~agentic_lora.engines.backends.IncarnationRecheck`): the listing's answer."""
        incarnation, _ = await self._cheapest_read(engine, self._admin(engine))
        return incarnation

    async def _cheapest_read(self, engine: EngineRef, admin: AdminT) -> tuple[str, dict[str, str]]:
        """The engine's incarnation and adapter listing, for a restart check (before a load,
        before a commit), not a health probe.

        One listing read while it still names every adapter this backend holds there (a
        restarted engine names none); else the fingerprint, read before a fresh listing, decides.
        """
        tracker = self._incarnations
        if tracker.holds_any(engine.name):
            listed = await admin.list_lora_adapters()
            known = tracker.unchanged(engine.name, listed)
            if known is not None:
                return known, listed
        return await self._full_read(engine, admin)

    async def prepare(
        self, engine: EngineRef, target: PublicationTarget, snapshot: AdapterSnapshot
    ) -> ReadyReceipt:
        """Store, load and probe ``target.lora_name`` on ``engine``."""
        extra = _extra(engine, target)
        if snapshot.digest != target.digest:
            raise target_refused(
                engine,
                target,
                f"snapshot digest {snapshot.digest[:16]} is not the target's {target.digest[:16]}",
                reason="digest_mismatch",
            )
        async with self._lock(engine, target.lora_name):
            if (
                self._fences.begin_prepare(engine.name, target.lora_name, target.attempt)
                is Verdict.FENCED
            ):
                raise target_refused(
                    engine,
                    target,
                    f"attempt {target.attempt} of {target.lora_name} is fenced on {engine.name} "
                    "(cleaned up, superseded or reclaimed); nothing was loaded",
                    reason="fenced",
                    attempt=target.attempt,
                )
            path = await self._store_snapshot(engine, target, snapshot)
            admin = self._admin(engine)
            try:
                # Read before the load: if the engine restarts after this point, its incarnation
                # no longer matches this receipt and the registry will not count it.
                incarnation, listed = await self._cheapest_read(engine, admin)
            except BackendError as exc:
                raise target_refused(
                    engine,
                    target,
                    f"{engine.name} unreadable before loading: {exc.message}",
                    reason="engine_unreadable",
                ) from exc
            held_at = listed.get(target.lora_name)
            if held_at is None:
                await self._load(engine, admin, target, path)
                logger.info("loaded %s on %s", target.lora_name, engine.name, extra=extra)
            elif held_at != str(path):
                raise target_ambiguous(
                    engine,
                    target,
                    f"{engine.name} already holds {target.lora_name} from {held_at}, not {path}",
                    reason="held_elsewhere",
                )
            else:
                logger.info(
                    "%s already holds %s; not loading it again",
                    engine.name,
                    target.lora_name,
                    extra=extra,
                )
            try:
                await self._probe(admin, target.lora_name)
            except BackendError as exc:
                raise target_ambiguous(
                    engine,
                    target,
                    f"{target.lora_name} is loaded on {engine.name} but does not serve: {exc.message}",
                    reason="probe_failed",
                ) from exc
            self._incarnations.hold(engine.name, target.lora_name)
            return ReadyReceipt(engine=engine.name, ref=target, incarnation=incarnation)

    async def cleanup(self, engine: EngineRef, target: PublicationTarget) -> None:
        """Unload this attempt's adapter and drop its directory (idempotent)."""
        extra = _extra(engine, target)
        async with self._lock(engine, target.lora_name):
            if (
                self._fences.begin_cleanup(engine.name, target.lora_name, target.attempt)
                is Verdict.STALE
            ):
                logger.info(
                    "stale cleanup of attempt %d of %s on %s ignored",
                    target.attempt,
                    target.lora_name,
                    engine.name,
                    extra=extra,
                )
                return
            await self._unload(engine, target.lora_name, op="cleanup")

    async def reclaim(self, engine: EngineRef, *, lora_name: str, reclaim_id: str) -> None:
        """Unload a retired version once its in-flight requests finished (once per reclaim id)."""
        key = (engine.name, reclaim_id)
        async with self._lock(engine, lora_name):
            if key in self._reclaimed:
                return  # already confirmed: a retry never sends a second unload
            self._fences.mark_reclaimed(engine.name, lora_name)
            await self._before_reclaim_unload(engine, lora_name)
            await self._unload(engine, lora_name, op="reclaim")
            self._reclaimed.add(key)

    async def stored_snapshot(self, lora_name: str, digest: str) -> AdapterSnapshot | None:
        """``lora_name``'s content rebuilt from any engine's store directory, or from the
        reclaimed versions kept for a rollback, or None.

        The store is immutable and every copy is verified (marker and content hash) against
        ``digest``, so whichever copy is read is the version's content. This is how a restarted
        publisher, which no longer has the snapshot in memory, loads a version onto a restarted
        engine again (see :mod:`agentic_lora.publication.repair`), and how a rollback loads a
        reclaimed version again.
        """
        return await asyncio.to_thread(self._stored_snapshot_sync, lora_name, digest)

    def _stored_snapshot_sync(self, lora_name: str, digest: str) -> AdapterSnapshot | None:
        if not self.store_root.is_dir():
            return None
        children = sorted(self.store_root.iterdir())
        for child in [*children, self.store_root / RECLAIMED_DIR]:
            if not child.is_dir() or not (
                _ENGINE_NAME.match(child.name) or child.name == RECLAIMED_DIR
            ):
                continue
            try:
                return AdapterStore(child).read_sync(lora_name, digest)
            except (VersionConflictError, OSError):
                continue  # absent, partial or other content here: another engine's copy may do
        return None

    async def aclose(self) -> None:
        """Close the shared HTTP client if this backend created it."""
        for admin in self._admins.values():
            await admin.aclose()
        if self._owns_client:
            await self._client.aclose()

    # --- helpers ------------------------------------------------------------------------------

    async def _store_snapshot(
        self, engine: EngineRef, target: PublicationTarget, snapshot: AdapterSnapshot
    ) -> Path:
        try:
            return await self._store(engine).put(target.lora_name, snapshot)
        except VersionConflictError as exc:
            raise target_refused(
                engine,
                target,
                f"stored copy of {target.lora_name} for {engine.name} does not match: {exc.message}",
                reason="manifest_mismatch",
                cause=exc.code,
            ) from exc
        except OSError as exc:
            raise target_refused(
                engine,
                target,
                f"cannot store {target.lora_name} for {engine.name}: {exc}",
                reason="store_failed",
            ) from exc

    async def _unload(self, engine: EngineRef, lora_name: str, *, op: str) -> None:
        extra = {"engine": engine.name, "version": lora_name}
        # No longer a restart witness: its absence is what we are about to cause.
        self._incarnations.release(engine.name, lora_name)
        try:
            outcome = await self._admin(engine).unload_lora_adapter(lora_name)
        except BackendError as exc:
            raise BackendAmbiguousError(
                f"{op} of {lora_name} on {engine.name} not confirmed: {exc.message}",
                engine=engine.name,
                version=lora_name,
                op=op,
                cause=exc.code,
            ) from exc
        logger.info("%s of %s on %s: %s", op, lora_name, engine.name, outcome.value, extra=extra)
        try:
            if op == "reclaim" and self.keep_reclaimed:
                await self._keep_reclaimed(engine, lora_name)
            else:
                await self._store(engine).remove(lora_name)
        except OSError:
            # The engine no longer serves the name; a leftover directory is disk, not state.
            logger.exception(
                "could not remove the stored %s for %s", lora_name, engine.name, extra=extra
            )

    async def _keep_reclaimed(self, engine: EngineRef, lora_name: str) -> None:
        """Move the engine's copy of ``lora_name`` out of its reach, into the reclaimed store
        (one copy per name is kept; the oldest beyond ``keep_reclaimed`` go)."""
        async with self._reclaimed_store_lock:  # the engines' reclaims run concurrently
            kept = AdapterStore(self.store_root / RECLAIMED_DIR)
            await asyncio.to_thread(self._store(engine).move_sync, lora_name, kept)
            await asyncio.to_thread(kept.keep_newest_sync, self.keep_reclaimed)

    def _admin(self, engine: EngineRef) -> AdminT:
        admin = self._admins.get(engine.name)
        if admin is None or admin.base_url != engine.base_url.rstrip("/"):
            admin = self._new_admin(engine)
            self._admins[engine.name] = admin
        return admin

    def _store(self, engine: EngineRef) -> AdapterStore:
        store = self._stores.get(engine.name)
        if store is None:
            if not _ENGINE_NAME.match(engine.name):
                raise ConfigurationError(
                    f"engine name {engine.name!r} cannot name a store directory", engine=engine.name
                )
            store = AdapterStore(self.store_root / engine.name)
            self._stores[engine.name] = store
        return store

    def _lock(self, engine: EngineRef, lora_name: str) -> asyncio.Lock:
        return self._locks.setdefault((engine.name, lora_name), asyncio.Lock())


def _extra(engine: EngineRef, target: PublicationTarget) -> dict[str, object]:
    return {"engine": engine.name, "version": target.version_id, "attempt": target.attempt}
