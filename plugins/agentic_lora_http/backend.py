"""HTTP push: publish a version by writing it to disk and asking SGLang to load it.

The prepare / cleanup / reclaim skeleton (immutable store, attempt fences, incarnation,
serialization per name, classification) is
:class:`~agentic_lora.engines.adapter_backend.AdapterDirectoryBackend`'s. What is SGLang's here:

* load: ``/load_lora_adapter`` ``{lora_name, lora_path, pinned: true}``; pinned, so the engine's
  LRU never evicts a managed version;
* probe: ``/generate`` one greedy token with ``lora_path`` naming the exact adapter;
* restart witness: the fingerprint of ``/server_info``
  (:func:`agentic_lora.engines.admin.server_fingerprint`);
* reclaim needs no wait of its own: ``/unload_lora_adapter`` first unregisters the name (no new
  request can acquire it), then waits for the engine's native request refcount to drain, then
  unloads.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import httpx

from agentic_lora.engines.adapter_backend import DEFAULT_KEEP_RECLAIMED
from agentic_lora.engines.adapter_backend import AdapterDirectoryBackend
from agentic_lora.engines.admin import AdminTimeouts
from agentic_lora.engines.admin import EngineAdminClient
from agentic_lora.engines.backends import EngineRef
from agentic_lora.engines.backends import PublicationTarget

__all__ = ["HttpPushBackend"]


class HttpPushBackend(AdapterDirectoryBackend[EngineAdminClient]):
    """The HTTP push :class:`~agentic_lora.engines.backends.Backend` for SGLang engines.

    ``store_root`` is an absolute directory the engines can read (each engine gets
    ``<store_root>/<engine name>/<lora name>``). ``client`` may be shared; otherwise one is created
    and closed by :meth:`aclose`. ``probe_input_ids`` is the prompt of the one-token probe.
    ``keep_reclaimed``: how many reclaimed versions the store keeps for a rollback (see
    :class:`~agentic_lora.engines.adapter_backend.AdapterDirectoryBackend`).
    """

    def __init__(
        self,
        store_root: str | os.PathLike[str],
        *,
        timeouts: AdminTimeouts | None = None,
        client: httpx.AsyncClient | None = None,
        probe_input_ids: Sequence[int] = (0,),
        keep_reclaimed: int = DEFAULT_KEEP_RECLAIMED,
    ) -> None:
        super().__init__(
            store_root, timeouts=timeouts, client=client, keep_reclaimed=keep_reclaimed
        )
        self.probe_input_ids = tuple(probe_input_ids)

    def _new_admin(self, engine: EngineRef) -> EngineAdminClient:
        return EngineAdminClient(
            engine.base_url, engine=engine.name, client=self._client, timeouts=self.timeouts
        )

    async def _fingerprint(self, engine: EngineRef, admin: EngineAdminClient) -> str:
        return (await admin.server_info()).fingerprint

    async def _load(
        self, engine: EngineRef, admin: EngineAdminClient, target: PublicationTarget, path: Path
    ) -> None:
        # The client confirms from the answer's adapter listing (name at exactly this path).
        await admin.load_lora_adapter(target.lora_name, str(path), pinned=True)

    async def _probe(self, admin: EngineAdminClient, lora_name: str) -> None:
        await admin.probe_generate(lora_name, input_ids=self.probe_input_ids)
