"""Publish versions to vLLM engines: write the adapter to disk, register it over HTTP.

Per engine:

* ``prepare``: write the snapshot into this engine's immutable store directory (verified if it is
  already there), read the engine's incarnation, ``/v1/load_lora_adapter`` ``{lora_name,
  lora_path}`` unless the engine already lists exactly that name at exactly that path, then
  complete one token with ``model=<lora_name>``. Only then is a READY receipt returned, carrying
  the incarnation read *before* the load.
* ``cleanup``: ``/v1/unload_lora_adapter``, then remove the store directory of exactly that name.
* ``reclaim``: **wait for the drain hook first**, check the engine no longer reports requests on
  the adapter, then unload and remove the directory.

How vLLM differs from SGLang, and what that costs here:

* **Unload does not wait.** SGLang's unload blocks until its native request refcount drains.
  vLLM's only removes the name from the API server's table and returns at once; requests already
  accepted keep their adapter and finish on the old weights. The engine also never pins: its
  worker keeps adapters in an LRU cache (``--max-cpu-loras``) and re-reads an evicted one from its
  ``lora_path`` when a request needs it. So if the directory were removed, or the capacity slot
  freed, while requests on the version are still in flight, one of them could find its adapter
  gone, and the registry would count a slot as free that the engine still uses. The backend
  therefore takes ``wait_drained(lora_name)``, an async callable from whoever tracks in-flight
  requests per adapter (the Session middleware), and awaits it before every reclaim. Once the
  registry has moved the version to RECLAIMING no new request for it is dispatched, so the wait
  ends. As a second witness, the engine's own ``vllm:lora_requests_info`` metric (adapters with
  running or waiting requests at the scheduler's last report) must not list the name; if it
  does, the reclaim is not confirmed (ambiguous, nothing unloaded) and a later round retries it.
* **No pinning, so immutable directories are load-bearing.** A directory is never rewritten while
  its version is held; an evicted adapter re-read from disk is byte-for-byte the published one.
  ``load_inplace`` is never used.
* **Prefix cache.** vLLM keys cached KV blocks by ``(lora_name, lora_path)``; names carry the
  digest and paths are per version, so two versions never share KV.
* **Incarnation.** vLLM publishes no boot id; ``process_start_time_seconds`` from ``/metrics``
  (the API server's start, which holds the adapter table) plays that part, combined with the same
  "a confirmed adapter went missing" generation counter the HTTP push plugin uses.

Classification follows :mod:`agentic_lora.backends`: a prepare the engine provably did not act on
is :class:`~agentic_lora.errors.BackendRefusedError`; anything that may have left the adapter
registered is :class:`~agentic_lora.errors.BackendAmbiguousError`; an unload that is not confirmed
is always ambiguous. Calls for one name on one engine are serialized and fenced by attempt
(:mod:`agentic_lora_http.fences`), as in the HTTP push plugin.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import re
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import httpx
from agentic_lora_http.fences import AttemptFences, Verdict
from agentic_lora_http.incarnation import IncarnationTracker

from agentic_lora.adapter import AdapterSnapshot
from agentic_lora.backends import EngineRef, PublicationTarget
from agentic_lora.engine_admin import AdminTimeouts
from agentic_lora.errors import (
    BackendAmbiguousError,
    BackendError,
    BackendRefusedError,
    ConfigurationError,
    VersionConflictError,
)
from agentic_lora.registry.types import ReadyReceipt
from agentic_lora.store import AdapterStore
from agentic_lora_vllm.admin import VllmAdminClient

__all__ = ["DrainHook", "VllmBackend"]

logger = logging.getLogger(__name__)

DrainHook = Callable[[str], Awaitable[None]]
"""``await wait_drained(lora_name)`` returns once no request using ``lora_name`` is in flight."""

_ENGINE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class VllmBackend:
    """The :class:`~agentic_lora.backends.Backend` for vLLM engines with runtime LoRA updating.

    ``store_root`` is an absolute directory the engines can read (each engine gets
    ``<store_root>/<engine name>/<lora name>``). ``wait_drained`` is required: see the module
    docstring for why vLLM needs it and SGLang does not. ``client`` may be shared; otherwise one
    is created and closed by :meth:`aclose`.
    """

    def __init__(
        self,
        store_root: str | os.PathLike[str],
        *,
        wait_drained: DrainHook,
        timeouts: AdminTimeouts | None = None,
        client: httpx.AsyncClient | None = None,
        probe_prompt_ids: Sequence[int] = (0,),
    ) -> None:
        root = Path(store_root)
        if not root.is_absolute():
            raise ConfigurationError(
                f"store_root must be an absolute path the engines can read: {root}",
                store_root=str(root),
            )
        if not callable(wait_drained):
            raise ConfigurationError(
                "the vLLM backend needs wait_drained(lora_name): vLLM's unload does not wait "
                "for in-flight requests",
                check="vllm_drain_hook",
            )
        self.store_root = root
        self.timeouts = timeouts or AdminTimeouts()
        self.probe_prompt_ids = tuple(probe_prompt_ids)
        self._wait_drained = wait_drained
        self._owns_client = client is None
        self._client = client or httpx.AsyncClient(
            timeout=httpx.Timeout(self.timeouts.read, connect=self.timeouts.connect)
        )
        self._admins: dict[str, VllmAdminClient] = {}
        self._stores: dict[str, AdapterStore] = {}
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        self._fences = AttemptFences()
        self._incarnations = IncarnationTracker()
        self._reclaimed: set[tuple[str, str]] = set()

    # --- Backend ----------------------------------------------------------------------------

    async def incarnation(self, engine: EngineRef) -> str:
        """``<fingerprint>.<generation>``: the API server's start time, and lost adapters."""
        admin = self._admin(engine)
        metrics = await admin.metrics()
        listed = await admin.list_lora_adapters()
        return self._incarnations.observe(
            engine.name, _fingerprint(engine, metrics.process_start_time), listed
        )

    async def prepare(
        self, engine: EngineRef, target: PublicationTarget, snapshot: AdapterSnapshot
    ) -> ReadyReceipt:
        """Store, register and probe ``target.lora_name`` on ``engine``."""
        extra = _extra(engine, target)
        if snapshot.digest != target.digest:
            raise BackendRefusedError(
                f"snapshot digest {snapshot.digest[:16]} is not the target's {target.digest[:16]}",
                engine=engine.name,
                version=target.version_id,
                reason="digest_mismatch",
            )
        async with self._lock(engine, target.lora_name):
            if (
                self._fences.begin_prepare(engine.name, target.lora_name, target.attempt)
                is Verdict.FENCED
            ):
                raise BackendRefusedError(
                    f"attempt {target.attempt} of {target.lora_name} is fenced on {engine.name} "
                    "(cleaned up, superseded or reclaimed); nothing was loaded",
                    engine=engine.name,
                    version=target.version_id,
                    attempt=target.attempt,
                    reason="fenced",
                )
            path = await self._store_snapshot(engine, target, snapshot)
            admin = self._admin(engine)
            try:
                metrics = await admin.metrics()
                listed = await admin.list_lora_adapters()
            except BackendError as exc:
                raise BackendRefusedError(
                    f"{engine.name} unreadable before loading: {exc.message}",
                    engine=engine.name,
                    version=target.version_id,
                    reason="engine_unreadable",
                ) from exc
            # Read before the load: if the engine restarts after this point, its incarnation no
            # longer matches this receipt and the registry will not count it.
            incarnation = self._incarnations.observe(
                engine.name, _fingerprint(engine, metrics.process_start_time), listed
            )
            held_at = listed.get(target.lora_name)
            if held_at is None:
                await self._load(admin, engine, target, path)
                logger.info("loaded %s on %s", target.lora_name, engine.name, extra=extra)
            elif held_at != str(path):
                raise BackendAmbiguousError(
                    f"{engine.name} already holds {target.lora_name} from {held_at}, not {path}",
                    engine=engine.name,
                    version=target.version_id,
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
                await admin.probe_completion(target.lora_name, prompt_ids=self.probe_prompt_ids)
            except BackendError as exc:
                raise BackendAmbiguousError(
                    f"{target.lora_name} is loaded on {engine.name} but does not serve: {exc.message}",
                    engine=engine.name,
                    version=target.version_id,
                    reason="probe_failed",
                ) from exc
            self._incarnations.hold(engine.name, target.lora_name)
            return ReadyReceipt(
                engine=engine.name,
                version_id=target.version_id,
                digest=target.digest,
                lora_name=target.lora_name,
                attempt=target.attempt,
                incarnation=incarnation,
            )

    async def cleanup(self, engine: EngineRef, target: PublicationTarget) -> None:
        """Unload this attempt's adapter and drop its directory (idempotent).

        No drain wait: a version is cleaned up only when its publication failed, so no Session
        was ever bound to it and no request but the backend's own probe used it.
        """
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
        """Wait until ``lora_name`` drained, then unload it (once per reclaim id)."""
        key = (engine.name, reclaim_id)
        extra = {"engine": engine.name, "version": lora_name}
        async with self._lock(engine, lora_name):
            if key in self._reclaimed:
                return  # already confirmed: a retry never sends a second unload
            self._fences.mark_reclaimed(engine.name, lora_name)
            logger.info("waiting for %s to drain", lora_name, extra=extra)
            try:
                await self._wait_drained(lora_name)
            except Exception as exc:
                # Nothing was unloaded; the version stays loaded and a later round retries.
                raise BackendAmbiguousError(
                    f"drain wait for {lora_name} failed before unloading it from {engine.name}: "
                    f"{type(exc).__name__}: {exc}",
                    engine=engine.name,
                    version=lora_name,
                    op="reclaim",
                    reason="drain_failed",
                ) from exc
            await self._check_engine_idle(engine, lora_name)
            await self._unload(engine, lora_name, op="reclaim")
            self._reclaimed.add(key)

    async def aclose(self) -> None:
        """Close the shared HTTP client if this backend created it."""
        for admin in self._admins.values():
            await admin.aclose()
        if self._owns_client:
            await self._client.aclose()

    # --- helpers ------------------------------------------------------------------------------

    async def _load(
        self, admin: VllmAdminClient, engine: EngineRef, target: PublicationTarget, path: Path
    ) -> None:
        refusal: BackendRefusedError | None = None
        try:
            await admin.load_lora_adapter(target.lora_name, str(path))
        except BackendRefusedError as exc:
            refusal = exc
        # Trust the listing over the answer: a success that does not show our adapter at our path
        # proves nothing, and a refusal with the name listed means it is held after all.
        try:
            held_at = (await admin.list_lora_adapters()).get(target.lora_name)
        except BackendError as exc:
            raise BackendAmbiguousError(
                f"cannot confirm the load of {target.lora_name} on {engine.name}: {exc.message}",
                engine=engine.name,
                version=target.version_id,
                reason="load_unconfirmed",
            ) from exc
        if refusal is not None:
            if held_at is None:
                raise refusal
            raise BackendAmbiguousError(
                f"{engine.name} refused to load {target.lora_name} but lists it: {refusal.message}",
                engine=engine.name,
                version=target.version_id,
                reason="refused_but_held",
            ) from refusal
        if held_at != str(path):
            raise BackendAmbiguousError(
                f"{engine.name} reported loading {target.lora_name} but lists it at {held_at}",
                engine=engine.name,
                version=target.version_id,
                reason="load_unconfirmed",
            )

    async def _check_engine_idle(self, engine: EngineRef, lora_name: str) -> None:
        try:
            activity = (await self._admin(engine).metrics()).lora_activity
        except BackendError as exc:
            raise BackendAmbiguousError(
                f"cannot read {engine.name}'s request activity before unloading {lora_name}: "
                f"{exc.message}",
                engine=engine.name,
                version=lora_name,
                op="reclaim",
                reason="activity_unreadable",
            ) from exc
        if activity is not None and activity.busy(lora_name):
            raise BackendAmbiguousError(
                f"{engine.name} still reports requests on {lora_name} after the drain; "
                "not unloaded, retry later",
                engine=engine.name,
                version=lora_name,
                op="reclaim",
                reason="engine_busy",
            )

    async def _store_snapshot(
        self, engine: EngineRef, target: PublicationTarget, snapshot: AdapterSnapshot
    ) -> Path:
        try:
            return await self._store(engine).put(target.lora_name, snapshot)
        except VersionConflictError as exc:
            raise BackendRefusedError(
                f"stored copy of {target.lora_name} for {engine.name} does not match: {exc.message}",
                engine=engine.name,
                version=target.version_id,
                reason="manifest_mismatch",
                cause=exc.code,
            ) from exc
        except OSError as exc:
            raise BackendRefusedError(
                f"cannot store {target.lora_name} for {engine.name}: {exc}",
                engine=engine.name,
                version=target.version_id,
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
            await self._store(engine).remove(lora_name)
        except OSError:
            # The engine no longer serves the name; a leftover directory is disk, not state.
            logger.exception(
                "could not remove the stored %s for %s", lora_name, engine.name, extra=extra
            )

    def _admin(self, engine: EngineRef) -> VllmAdminClient:
        admin = self._admins.get(engine.name)
        if admin is None or admin.base_url != engine.base_url.rstrip("/"):
            admin = VllmAdminClient(
                engine.base_url, engine=engine.name, client=self._client, timeouts=self.timeouts
            )
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


def _fingerprint(engine: EngineRef, process_start_time: float | None) -> str:
    # The base URL is part of it: another process on another port is another engine, even if
    # both started in the same clock tick.
    canonical = json.dumps(
        {"base_url": engine.base_url.rstrip("/"), "process_start_time": process_start_time},
        sort_keys=True,
    )
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def _extra(engine: EngineRef, target: PublicationTarget) -> dict[str, object]:
    return {"engine": engine.name, "version": target.version_id, "attempt": target.attempt}
