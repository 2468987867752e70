"""Publish versions to vLLM engines: write the adapter to disk, register it over HTTP.

Per engine:

* ``prepare``: write the snapshot into this engine's immutable store directory (verified if it is
  already there), read the engine's incarnation, ``/v1/load_lora_adapter`` ``{lora_name,
  lora_path}`` unless the engine already lists exactly that name at exactly that path, then
  complete one token with ``model=<lora_name>``. Only then is a READY receipt returned, carrying
  the incarnation read *before* the load.
* ``cleanup``: ``/v1/unload_lora_adapter``, then remove the store directory of exactly that name.
  No drain wait: a version is cleaned up only when its publication failed, so no Session was ever
  bound to it and no request but the backend's own probe used it.
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
  (the API server's start, which holds the adapter table) plays that part (read by the dialect,
  :meth:`agentic_lora_vllm.dialect.VllmDialect.fingerprint`), combined with the same "a confirmed
  adapter went missing" generation counter the HTTP push plugin uses.

The skeleton (store, attempt fences, incarnation generation, serialization per name,
classification) is :class:`~agentic_lora.engines.adapter_backend.AdapterDirectoryBackend`'s, shared with
the HTTP push plugin; this module holds only what vLLM does differently: the load confirmed by the
listing, the probe by completion, the restart witness, and the drain before a reclaim's unload.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

import httpx

from agentic_lora.engines.adapter_backend import DEFAULT_KEEP_RECLAIMED
from agentic_lora.engines.adapter_backend import AdapterDirectoryBackend
from agentic_lora.engines.adapter_backend import DrainHook
from agentic_lora.engines.admin import AdminTimeouts
from agentic_lora.engines.backends import EngineRef
from agentic_lora.engines.backends import PublicationTarget
from agentic_lora.engines.backends import target_ambiguous
from agentic_lora.errors import BackendAmbiguousError
from agentic_lora.errors import BackendError
from agentic_lora.errors import BackendRefusedError
from agentic_lora.errors import ConfigurationError
from agentic_lora_vllm.admin import VllmAdminClient
from agentic_lora_vllm.dialect import VllmDialect

__all__ = ["DrainHook", "VllmBackend"]

logger = logging.getLogger(__name__)

# How the incarnation is read is the dialect's (one reader for every client of the engine).
_DIALECT = VllmDialect()


class VllmBackend(AdapterDirectoryBackend[VllmAdminClient]):
    """The :class:`~agentic_lora.engines.backends.Backend` for vLLM engines with runtime LoRA updating.

    ``store_root`` is an absolute directory the engines can read (each engine gets
    ``<store_root>/<engine name>/<lora name>``). ``wait_drained`` is required: see the module
    docstring for why vLLM needs it and SGLang does not
    (:meth:`agentic_lora.session.Versioning.wait_drained` is the Session middleware's, and
    :meth:`agentic_lora.assembly.deployment.Deployment.from_settings` wires it in). ``client`` may be
    shared; otherwise one is created and closed by :meth:`aclose`. ``keep_reclaimed``: how many
    reclaimed versions the store keeps for a rollback (see
    :class:`~agentic_lora.engines.adapter_backend.AdapterDirectoryBackend`).
    """

    def __init__(
        self,
        store_root: str | os.PathLike[str],
        *,
        wait_drained: DrainHook,
        timeouts: AdminTimeouts | None = None,
        client: httpx.AsyncClient | None = None,
        probe_prompt_ids: Sequence[int] = (0,),
        keep_reclaimed: int = DEFAULT_KEEP_RECLAIMED,
    ) -> None:
        if not callable(wait_drained):
            raise ConfigurationError(
                "the vLLM backend needs wait_drained(lora_name): vLLM's unload does not wait "
                "for in-flight requests",
                check="vllm_drain_hook",
            )
        super().__init__(
            store_root, timeouts=timeouts, client=client, keep_reclaimed=keep_reclaimed
        )
        self.probe_prompt_ids = tuple(probe_prompt_ids)
        self._wait_drained = wait_drained

    # --- hooks --------------------------------------------------------------------------------

    def _new_admin(self, engine: EngineRef) -> VllmAdminClient:
        return VllmAdminClient(
            engine.base_url, engine=engine.name, client=self._client, timeouts=self.timeouts
        )

    async def _fingerprint(self, engine: EngineRef, admin: VllmAdminClient) -> str:
        return await _DIALECT.fingerprint(admin, engine.base_url)

    async def _probe(self, admin: VllmAdminClient, lora_name: str) -> None:
        await admin.probe_completion(lora_name, prompt_ids=self.probe_prompt_ids)

    async def _load(
        self, engine: EngineRef, admin: VllmAdminClient, target: PublicationTarget, path: Path
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
            raise target_ambiguous(
                engine,
                target,
                f"cannot confirm the load of {target.lora_name} on {engine.name}: {exc.message}",
                reason="load_unconfirmed",
            ) from exc
        if refusal is not None:
            if held_at is None:
                raise refusal
            raise target_ambiguous(
                engine,
                target,
                f"{engine.name} refused to load {target.lora_name} but lists it: {refusal.message}",
                reason="refused_but_held",
            ) from refusal
        if held_at != str(path):
            raise target_ambiguous(
                engine,
                target,
                f"{engine.name} reported loading {target.lora_name} but lists it at {held_at}",
                reason="load_unconfirmed",
            )

    async def _before_reclaim_unload(self, engine: EngineRef, lora_name: str) -> None:
        """Wait for the drain hook, then check the engine reports no request on ``lora_name``."""
        extra = {"engine": engine.name, "version": lora_name}
        logger.info("waiting for %s to drain", lora_name, extra=extra)
        try:
            await self._wait_drained(lora_name)
        except Exception as exc:
            raise _not_reclaimed(
                engine,
                lora_name,
                f"drain wait for {lora_name} failed before unloading it from {engine.name}: "
                f"{type(exc).__name__}: {exc}",
                reason="drain_failed",
            ) from exc
        await self._check_engine_idle(engine, lora_name)

    async def _check_engine_idle(self, engine: EngineRef, lora_name: str) -> None:
        try:
            activity = (await self._admin(engine).metrics()).lora_activity
        except BackendError as exc:
            raise _not_reclaimed(
                engine,
                lora_name,
                f"cannot read {engine.name}'s request activity before unloading {lora_name}: "
                f"{exc.message}",
                reason="activity_unreadable",
            ) from exc
        if activity is not None and activity.busy(lora_name):
            raise _not_reclaimed(
                engine,
                lora_name,
                f"{engine.name} still reports requests on {lora_name} after the drain; "
                "not unloaded, retry later",
                reason="engine_busy",
            )


def _not_reclaimed(
    engine: EngineRef, lora_name: str, message: str, *, reason: str
) -> BackendAmbiguousError:
    """A reclaim stopped before its unload: the version stays loaded, a later round retries."""
    return BackendAmbiguousError(
        message, engine=engine.name, version=lora_name, op="reclaim", reason=reason
    )
