"""A scripted stand-in for one SGLang engine's HTTP surface, served through respx.

It models what the publication and reclaim paths depend on, as SGLang 0.5.23 behaves:

* ``/load_lora_adapter`` reads the adapter directory at ``lora_path`` (it must exist), refuses a
  name that is already loaded and refuses to pin more than ``max_loras_per_batch - 1`` adapters;
* ``/unload_lora_adapter`` unregisters the name at once, then waits until every in-flight
  request holding it has finished (the native refcount) before the physical unload; an unknown
  name answers ``success: false`` "... does not exist";
* ``/generate`` with ``lora_path`` acquires the adapter for the request; a name that was loaded
  once and unloaded since is *implicitly reloaded* from its cached path, as SGLang does;
* ``/server_info`` (or ``/get_server_info`` when ``legacy_server_info``) reports
  ``startup_time`` and ``random_seed``, which change on :meth:`ScriptedSGLangEngine.restart`;
* ``/v1/models`` lists the base model and one card per registered adapter;
* ``/generate`` with ``"stream": true`` answers the next :class:`ScriptedStream` queued in
  ``streams`` (a plain one when none is): the request holds its adapter until the stream ends
  or its reader leaves, and ``/abort_request {"rid": ...}`` ends it with an ``abort`` chunk.

Faults (:class:`~agentic_lora.testing.scripted_engine.Fault`) are scripted per operation, one
per future call; a refusal answers ``success: false``. What every scripted engine shares is
:class:`~agentic_lora.testing.scripted_engine.ScriptedEngine`. Deterministic: no clocks, no
randomness, no sleeps.
"""

from __future__ import annotations

import asyncio
import os
import zlib
from collections import Counter
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field
from typing import Any

import httpx

from agentic_lora.testing.scripted_engine import COMMON_OPS
from agentic_lora.testing.scripted_engine import EngineOp
from agentic_lora.testing.scripted_engine import Fault
from agentic_lora.testing.scripted_engine import FaultKind
from agentic_lora.testing.scripted_engine import Handler
from agentic_lora.testing.scripted_engine import HeldAdapter
from agentic_lora.testing.scripted_engine import ScriptedEngine
from agentic_lora.testing.streams import ScriptedStream
from agentic_lora.testing.streams import generate_chunks
from agentic_lora.testing.streams import stream_reply

__all__ = ["EngineOp", "Fault", "FaultKind", "LoadedAdapter", "ScriptedSGLangEngine"]

# EngineOp, Fault and FaultKind live in scripted_engine (shared by every scripted engine); they
# are re-exported here because most tests script SGLang faults.


@dataclass(frozen=True, slots=True)
class LoadedAdapter(HeldAdapter):
    """One registered adapter, pinned or not, under the engine's own id for it."""

    pinned: bool
    lora_id: int


@dataclass
class _Boot:
    number: int
    random_seed: int
    startup_time: dict[str, float]


def _readable_adapter_dir(path: str) -> bool:
    return os.path.isabs(path) and os.path.isfile(os.path.join(path, "adapter_config.json"))


def _digest_of_dir(path: str) -> str:
    from agentic_lora.adapters.snapshot import AdapterSnapshot

    return AdapterSnapshot.from_peft_dir(path).digest


@dataclass
class ScriptedSGLangEngine(ScriptedEngine[LoadedAdapter]):
    """One fake SGLang engine at ``base_url`` (mount it on a respx router)."""

    max_loras_per_batch: int = 3
    legacy_server_info: bool = False
    #: ``--disaggregation-mode``: ``"prefill"`` or ``"decode"`` (None: a plain engine; unreported).
    disaggregation_mode: str | None = None
    #: Report the LoRA settings the start-up check reads (``enable_lora``, the slot counts).
    report_lora_settings: bool = False
    max_loaded_loras: int = 3
    #: Reads a stored adapter directory and returns its content digest (None: do not read).
    read_digest: Callable[[str], str] | None = _digest_of_dir
    implicit_reloads: Counter[str] = field(default_factory=Counter)
    #: Streamed answers for the next streamed generations, in order.
    streams: deque[ScriptedStream] = field(default_factory=deque)
    #: Every streamed answer given, by request id (None: the request carried none).
    streamed: dict[str | None, ScriptedStream] = field(default_factory=dict)

    ops = COMMON_OPS | {EngineOp.GENERATE, EngineOp.SERVER_INFO, EngineOp.ABORT}

    def __post_init__(self) -> None:
        super().__post_init__()
        self._inflight: Counter[int] = Counter()
        self._drained = asyncio.Condition()
        #: Set while an unload waits for in-flight requests on its adapter to finish.
        self.unload_blocked = asyncio.Event()
        self._ref_cache: dict[str, tuple[str, bool]] = {}
        self._unregistered: dict[str, LoadedAdapter] = {}
        self._next_lora_id = 1
        self._boot = self._new_boot(0)

    # --- test controls ------------------------------------------------------------------------

    def routes(self) -> list[tuple[str, str, Handler]]:
        return [
            ("POST", "/load_lora_adapter", self._load),
            ("POST", "/unload_lora_adapter", self._unload),
            ("POST", "/generate", self._generate),
            ("POST", "/abort_request", self._abort),
            ("GET", "/server_info", self._server_info_new),
            ("GET", "/get_server_info", self._server_info_legacy),
        ]

    def fault_reply(self, op: EngineOp, kind: FaultKind, message: str) -> httpx.Response:
        if kind is FaultKind.SERVER_ERROR:
            return httpx.Response(500, json={"error": {"message": message}})
        if op is EngineOp.GENERATE:
            # A generation refuses with a 400 and an OpenAI-style error, never ``success``.
            return httpx.Response(400, json={"error": {"message": message}})
        status = 400 if kind is FaultKind.REFUSE else 200
        return httpx.Response(status, json={"success": False, "error_message": message})

    def restart(self) -> None:
        """The engine process restarts: every adapter and every in-flight request is gone."""
        super().restart()
        self._boot = self._new_boot(self.restarts)
        self._ref_cache.clear()
        self._unregistered.clear()
        self._inflight.clear()

    def register(self, lora_name: str, lora_path: str, digest: str | None = None) -> None:
        """Hold ``lora_name`` as if it had been loaded from ``lora_path`` (no directory read)."""
        self._register(lora_name, lora_path, False, digest)

    def acquire(self, lora_name: str) -> int:
        """Start a long request on ``lora_name`` (it holds the native refcount); returns its id."""
        adapter = self.adapters[lora_name]
        self._inflight[adapter.lora_id] += 1
        return adapter.lora_id

    async def release(self, lora_id: int) -> None:
        """Finish a request started with :meth:`acquire`."""
        async with self._drained:
            self._inflight[lora_id] -= 1
            self._drained.notify_all()

    def inflight(self, lora_name: str) -> int:
        adapter = self.adapters.get(lora_name) or self._unregistered.get(lora_name)
        return 0 if adapter is None else self._inflight[adapter.lora_id]

    # --- handlers -----------------------------------------------------------------------------

    async def _load(self, request: httpx.Request) -> httpx.Response:
        body, fault = await self._enter(EngineOp.LOAD, request)
        name = str(body.get("lora_name"))
        path = str(body.get("lora_path"))
        pinned = bool(body.get("pinned", False))
        if name in self.adapters:
            return self._lora_reply(
                400, f"Failed to load LoRA adapter {name} because it is already loaded"
            )
        if not _readable_adapter_dir(path):
            return self._lora_reply(400, f"Can't find adapter_config.json in {path}")
        pinned_now = sum(1 for a in self.adapters.values() if a.pinned)
        if pinned and pinned_now >= self.max_loras_per_batch - 1:
            return self._lora_reply(
                400,
                f"Already have {pinned_now} pinned adapters, max allowed is {self.max_loras_per_batch - 1}",
            )
        digest = self.read_digest(path) if self.read_digest is not None else None
        self._register(name, path, pinned, digest)
        return self._finish(fault, request, self._lora_reply(200, None))

    def _register(self, name: str, path: str, pinned: bool, digest: str | None) -> None:
        self.adapters[name] = LoadedAdapter(name, path, digest, pinned, self._next_lora_id)
        self._next_lora_id += 1
        self._ref_cache[name] = (path, pinned)
        self.physical_loads[name] += 1

    async def _unload(self, request: httpx.Request) -> httpx.Response:
        body, fault = await self._enter(EngineOp.UNLOAD, request)
        name = str(body.get("lora_name"))
        adapter = self.adapters.pop(name, None) or self._unregistered.get(name)
        if adapter is None:
            return self._lora_reply(
                400, f"LoRA with name {name} does not exist. Loaded LoRAs: {list(self.adapters)}"
            )
        # Unregistered first: no new request can acquire it while the old ones drain.
        self._unregistered[name] = adapter
        boot = self._boot.number
        async with self._drained:
            if self._inflight[adapter.lora_id] > 0:
                self.unload_blocked.set()
            await self._drained.wait_for(lambda: self._inflight[adapter.lora_id] <= 0)
            self.unload_blocked.clear()
        if boot != self._boot.number:
            raise httpx.RemoteProtocolError("engine restarted during unload", request=request)
        self._unregistered.pop(name, None)
        self.physical_unloads[name] += 1
        return self._finish(fault, request, self._lora_reply(200, None))

    async def _generate(self, request: httpx.Request) -> httpx.Response:
        body, fault = await self._enter(EngineOp.GENERATE, request)
        name = body.get("lora_path")
        if name is not None and name not in self.adapters:
            cached = self._ref_cache.get(str(name))
            if cached is None or name in self._unregistered:
                return httpx.Response(
                    400,
                    json={
                        "error": {"message": f"Got LoRA adapter that has never been loaded: {name}"}
                    },
                )
            if not _readable_adapter_dir(cached[0]):
                return httpx.Response(
                    400,
                    json={"error": {"message": f"Reloading {name} failed: {cached[0]} is gone"}},
                )
            # SGLang reloads an adapter it loaded once, from the cached path, on demand.
            digest = self.read_digest(cached[0]) if self.read_digest is not None else None
            self._register(str(name), cached[0], cached[1], digest)
            self.implicit_reloads[str(name)] += 1
        if body.get("stream"):
            return self._finish(fault, request, self._stream(body, name))
        reply = httpx.Response(
            200,
            json={
                "text": "x",
                "output_ids": [7],
                "meta_info": {"finish_reason": {"type": "length", "length": 1}, "lora_path": name},
            },
        )
        return self._finish(fault, request, reply)

    def _stream(self, body: dict[str, Any], name: Any) -> httpx.Response:
        stream = self.streams.popleft() if self.streams else ScriptedStream()
        rid = body.get("rid")
        if stream.chunks is None:
            stream.chunks = generate_chunks(3, rid, name)
        if name is not None:
            # Like the real engine: the request holds the adapter's refcount while it streams.
            lora_id = self.acquire(str(name))

            async def release() -> None:
                await self.release(lora_id)

            stream.on_end = release
        self.streamed[rid] = stream
        return stream_reply(stream)

    async def _abort(self, request: httpx.Request) -> httpx.Response:
        body, fault = await self._enter(EngineOp.ABORT, request)
        stream = self.streamed.get(body.get("rid"))
        if stream is not None:
            stream.abort()
        return self._finish(fault, request, httpx.Response(200))

    async def _server_info_new(self, request: httpx.Request) -> httpx.Response:
        if self.legacy_server_info:
            return httpx.Response(404, json={"detail": "Not Found"})
        return await self._server_info(request)

    async def _server_info_legacy(self, request: httpx.Request) -> httpx.Response:
        return await self._server_info(request)

    async def _server_info(self, request: httpx.Request) -> httpx.Response:
        _, fault = await self._enter(EngineOp.SERVER_INFO, request)
        info = {
            "model_path": self.served_model_name,
            "served_model_name": self.served_model_name,
            "port": 30000,
            "random_seed": self._boot.random_seed,
            "startup_time": self._boot.startup_time,
            # Changes on every call: a fingerprint must not depend on it.
            "internal_states": [{"last_gen_throughput": float(len(self.calls))}],
            "version": "0.5.23",
        }
        if self.disaggregation_mode is not None:
            info["disaggregation_mode"] = self.disaggregation_mode
        if self.report_lora_settings:
            info["enable_lora"] = True
            info["max_loaded_loras"] = self.max_loaded_loras
            info["max_loras_per_batch"] = self.max_loras_per_batch
        return self._finish(fault, request, httpx.Response(200, json=info))

    def _lora_reply(self, status: int, error: str | None) -> httpx.Response:
        return httpx.Response(
            status,
            json={
                "success": error is None,
                "error_message": error,
                "loaded_adapters": {a.lora_name: a.lora_path for a in self.adapters.values()},
            },
        )

    def _new_boot(self, number: int) -> _Boot:
        # Deterministic per (engine, boot) but different on every restart, like a real process.
        seed = (zlib.crc32(self.name.encode()) & 0xFFFF) * 1000 + number
        return _Boot(
            number,
            random_seed=seed,
            startup_time={"load_weight": 1.25 + number / 1000, "scheduler_e2e": 3.5 + number / 997},
        )
