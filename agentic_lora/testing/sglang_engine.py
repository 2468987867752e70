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
* ``/v1/models`` lists the base model and one card per registered adapter.

Faults are scripted per operation with :meth:`ScriptedSGLangEngine.script`, one per future call,
so a test decides exactly which call fails and how (refuse, answer 200 with ``success: false``,
act but lose the reply, be unreachable, wait on an :class:`asyncio.Event`, restart after acting).
Everything is deterministic: no clocks, no randomness, no sleeps.
"""

from __future__ import annotations

import asyncio
import enum
import json
import os
import zlib
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

__all__ = ["EngineOp", "Fault", "FaultKind", "LoadedAdapter", "ScriptedSGLangEngine"]


class EngineOp(enum.StrEnum):
    """The engine calls a fault can be scripted for."""

    LOAD = "load"
    UNLOAD = "unload"
    GENERATE = "generate"
    SERVER_INFO = "server_info"
    MODELS = "models"


class FaultKind(enum.StrEnum):
    REFUSE = "refuse"  # HTTP 400, success false; nothing done
    OK_BUT_FAILED = "ok_but_failed"  # HTTP 200, success false; nothing done
    SERVER_ERROR = "server_error"  # HTTP 500; nothing done (the caller cannot know that)
    UNREACHABLE = "unreachable"  # connection refused; never reached the engine
    LOSE_REPLY = "lose_reply"  # done, then the connection drops before the answer
    RESTART_AFTER = "restart_after"  # done and answered, then the engine process restarts
    GATE = "gate"  # waits for ``gate`` to be set, then behaves normally


@dataclass(frozen=True, slots=True)
class Fault:
    """One scripted deviation for the next call of an operation."""

    kind: FaultKind
    message: str = "scripted failure"
    gate: asyncio.Event | None = None
    reached: asyncio.Event | None = None

    @classmethod
    def waiting_for(cls, gate: asyncio.Event, reached: asyncio.Event | None = None) -> Fault:
        """Hold the call until ``gate`` is set; set ``reached`` when the call arrives."""
        return cls(FaultKind.GATE, gate=gate, reached=reached)


@dataclass(slots=True)
class LoadedAdapter:
    """One registered adapter: where it was read from and what it holds."""

    lora_name: str
    lora_path: str
    pinned: bool
    lora_id: int
    digest: str | None


@dataclass
class _Boot:
    number: int
    random_seed: int
    startup_time: dict[str, float]


def _readable_adapter_dir(path: str) -> bool:
    return os.path.isabs(path) and os.path.isfile(os.path.join(path, "adapter_config.json"))


def _digest_of_dir(path: str) -> str:
    from agentic_lora.adapter import AdapterSnapshot

    return AdapterSnapshot.from_peft_dir(path).digest


@dataclass
class ScriptedSGLangEngine:
    """One fake SGLang engine at ``base_url`` (mount it on a respx router)."""

    name: str
    base_url: str
    served_model_name: str = "base-model"
    max_loras_per_batch: int = 3
    legacy_server_info: bool = False
    #: Reads a stored adapter directory and returns its content digest (None: do not read).
    read_digest: Callable[[str], str] | None = _digest_of_dir

    adapters: dict[str, LoadedAdapter] = field(default_factory=dict)
    physical_loads: Counter[str] = field(default_factory=Counter)
    physical_unloads: Counter[str] = field(default_factory=Counter)
    implicit_reloads: Counter[str] = field(default_factory=Counter)
    calls: list[tuple[EngineOp, dict[str, Any]]] = field(default_factory=list)
    restarts: int = 0

    def __post_init__(self) -> None:
        self.base_url = self.base_url.rstrip("/")
        self._faults: dict[EngineOp, deque[Fault]] = {op: deque() for op in EngineOp}
        self._inflight: Counter[int] = Counter()
        self._drained = asyncio.Condition()
        #: Set while an unload waits for in-flight requests on its adapter to finish.
        self.unload_blocked = asyncio.Event()
        self._ref_cache: dict[str, tuple[str, bool]] = {}
        self._unregistered: dict[str, LoadedAdapter] = {}
        self._next_lora_id = 1
        self._boot = self._new_boot(0)

    # --- test controls ------------------------------------------------------------------------

    def mount(self, router: Any) -> None:
        """Route this engine's endpoints on a ``respx`` router (or the ``respx`` module)."""
        routes: list[tuple[str, str, Callable[[httpx.Request], Any]]] = [
            ("POST", "/load_lora_adapter", self._load),
            ("POST", "/unload_lora_adapter", self._unload),
            ("POST", "/generate", self._generate),
            ("GET", "/server_info", self._server_info_new),
            ("GET", "/get_server_info", self._server_info_legacy),
            ("GET", "/v1/models", self._models),
        ]
        for method, path, handler in routes:
            router.route(method=method, url=self.base_url + path).mock(side_effect=handler)

    def script(self, op: EngineOp, *faults: Fault) -> None:
        """Queue faults for the next calls of ``op`` (one fault per call, in order)."""
        self._faults[op].extend(faults)

    def clear_script(self) -> None:
        """Drop every scripted fault not consumed yet."""
        for queue in self._faults.values():
            queue.clear()

    def restart(self) -> None:
        """The engine process restarts: every adapter and every in-flight request is gone."""
        self.restarts += 1
        self._boot = self._new_boot(self.restarts)
        self.adapters.clear()
        self._ref_cache.clear()
        self._unregistered.clear()
        self._inflight.clear()

    def holds(self, lora_name: str) -> bool:
        """Whether ``lora_name`` is registered (servable) right now."""
        return lora_name in self.adapters

    def held_digest(self, lora_name: str) -> str | None:
        adapter = self.adapters.get(lora_name)
        return None if adapter is None else adapter.digest

    def count(self, op: EngineOp) -> int:
        """How many calls of ``op`` reached this engine (unreachable ones excluded)."""
        return sum(1 for o, _ in self.calls if o is op)

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

    async def _enter(
        self, op: EngineOp, request: httpx.Request
    ) -> tuple[dict[str, Any], Fault | None]:
        fault = self._faults[op].popleft() if self._faults[op] else None
        if fault is not None and fault.kind is FaultKind.UNREACHABLE:
            raise httpx.ConnectError("connection refused (scripted)", request=request)
        body: dict[str, Any] = json.loads(request.content) if request.content else {}
        self.calls.append((op, body))
        if fault is not None and fault.kind is FaultKind.GATE:
            assert fault.gate is not None
            if fault.reached is not None:
                fault.reached.set()
            await fault.gate.wait()
            fault = None
        return body, fault

    @staticmethod
    def _short_circuit(fault: Fault | None) -> httpx.Response | None:
        if fault is None:
            return None
        if fault.kind is FaultKind.REFUSE:
            return httpx.Response(400, json={"success": False, "error_message": fault.message})
        if fault.kind is FaultKind.OK_BUT_FAILED:
            return httpx.Response(200, json={"success": False, "error_message": fault.message})
        if fault.kind is FaultKind.SERVER_ERROR:
            return httpx.Response(500, json={"error": {"message": fault.message}})
        return None

    def _finish(
        self, fault: Fault | None, request: httpx.Request, response: httpx.Response
    ) -> httpx.Response:
        if fault is not None and fault.kind is FaultKind.LOSE_REPLY:
            raise httpx.ReadError("connection dropped before the reply (scripted)", request=request)
        if fault is not None and fault.kind is FaultKind.RESTART_AFTER:
            self.restart()
        return response

    async def _load(self, request: httpx.Request) -> httpx.Response:
        body, fault = await self._enter(EngineOp.LOAD, request)
        if (early := self._short_circuit(fault)) is not None:
            return early
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
        self.adapters[name] = LoadedAdapter(name, path, pinned, self._next_lora_id, digest)
        self._next_lora_id += 1
        self._ref_cache[name] = (path, pinned)
        self.physical_loads[name] += 1

    async def _unload(self, request: httpx.Request) -> httpx.Response:
        body, fault = await self._enter(EngineOp.UNLOAD, request)
        if (early := self._short_circuit(fault)) is not None:
            return early
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
        if fault is not None and fault.kind in (FaultKind.REFUSE, FaultKind.OK_BUT_FAILED):
            return httpx.Response(400, json={"error": {"message": fault.message}})
        if (early := self._short_circuit(fault)) is not None:
            return early
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
        reply = httpx.Response(
            200,
            json={
                "text": "x",
                "output_ids": [7],
                "meta_info": {"finish_reason": {"type": "length", "length": 1}, "lora_path": name},
            },
        )
        return self._finish(fault, request, reply)

    async def _server_info_new(self, request: httpx.Request) -> httpx.Response:
        if self.legacy_server_info:
            return httpx.Response(404, json={"detail": "Not Found"})
        return await self._server_info(request)

    async def _server_info_legacy(self, request: httpx.Request) -> httpx.Response:
        return await self._server_info(request)

    async def _server_info(self, request: httpx.Request) -> httpx.Response:
        _, fault = await self._enter(EngineOp.SERVER_INFO, request)
        if (early := self._short_circuit(fault)) is not None:
            return early
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
        return self._finish(fault, request, httpx.Response(200, json=info))

    async def _models(self, request: httpx.Request) -> httpx.Response:
        _, fault = await self._enter(EngineOp.MODELS, request)
        if (early := self._short_circuit(fault)) is not None:
            return early
        cards: list[dict[str, Any]] = [
            {
                "id": self.served_model_name,
                "object": "model",
                "root": self.served_model_name,
                "parent": None,
            }
        ]
        cards.extend(
            {
                "id": a.lora_name,
                "object": "model",
                "root": a.lora_path,
                "parent": self.served_model_name,
            }
            for a in self.adapters.values()
        )
        return self._finish(
            fault, request, httpx.Response(200, json={"object": "list", "data": cards})
        )

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
