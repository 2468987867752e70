"""A scripted stand-in for one vLLM 0.32.0 engine's HTTP surface, served through respx.

It models what the vLLM backend depends on, as the project's behaviour tests pin it against the
real engine:

* ``/v1/load_lora_adapter`` answers 200 with plain text ``Success: ...``; a name already loaded
  is 400 ``InvalidUserInput``; a path without an adapter is 404 ``NotFoundError``;
* ``/v1/unload_lora_adapter`` forgets the name at once (requests already running on it keep
  running) and answers 200 ``Success: ...``; an unknown name is 404 ``NotFoundError`` "... cannot
  be found."; with ``runtime_lora_updating=False`` neither route exists (404 ``{"detail": ...}``);
* ``/v1/completions`` and ``/v1/chat/completions`` with ``model=<name>`` need the name registered
  (else 404 "The model ... does not exist.") and echo the name as ``model``;
* ``/metrics`` has ``process_start_time_seconds`` (new on every :meth:`restart`) and
  ``vllm:lora_requests_info`` samples, one label set per distinct report, newest value last;
* ``/v1/models`` lists the base model and one card per registered adapter;
* ``"stream": true`` answers the next :class:`ScriptedStream` queued in ``streams`` (a plain one
  when none is); there is no abort by id: a reader that leaves closes the connection, which the
  stream records (``closed_early``), as vLLM aborts a request whose client disconnected.

Faults (:class:`~agentic_lora.testing.scripted_engine.Fault`) are scripted per operation, one
per future call; a refusal answers vLLM's ``{"error": {...}}`` body. What every scripted engine
shares is :class:`~agentic_lora.testing.scripted_engine.ScriptedEngine`. Deterministic: no
clocks, no randomness, no sleeps.
"""

from __future__ import annotations

import os
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
from agentic_lora.testing.streams import openai_chunks
from agentic_lora.testing.streams import stream_reply

__all__ = ["EngineOp", "Fault", "FaultKind", "HeldAdapter", "ScriptedVllmEngine"]


def _error(status: int, message: str, err_type: str) -> httpx.Response:
    return httpx.Response(
        status,
        json={"error": {"message": message, "type": err_type, "param": None, "code": status}},
    )


async def _absent(request: httpx.Request) -> httpx.Response:
    return httpx.Response(404, json={"detail": "Not Found"})


def _digest_of_dir(path: str) -> str | None:
    if not os.path.isabs(path) or not os.path.isfile(os.path.join(path, "adapter_config.json")):
        return None
    from agentic_lora.adapters.snapshot import AdapterSnapshot

    return AdapterSnapshot.from_peft_dir(path).digest


@dataclass
class ScriptedVllmEngine(ScriptedEngine[HeldAdapter]):
    """One fake vLLM engine at ``base_url`` (mount it on a respx router)."""

    runtime_lora_updating: bool = True
    read_digest: Callable[[str], str | None] = _digest_of_dir
    #: Streamed answers for the next streamed generations, in order.
    streams: deque[ScriptedStream] = field(default_factory=deque)
    #: Every streamed answer given, in order.
    streamed: list[ScriptedStream] = field(default_factory=list)

    ops = COMMON_OPS | {EngineOp.COMPLETION, EngineOp.CHAT, EngineOp.METRICS}

    def __post_init__(self) -> None:
        super().__post_init__()
        self._running: Counter[str] = Counter()
        self._reports: list[tuple[frozenset[str], float]] = []
        self._clock = 0.0

    # --- test controls ------------------------------------------------------------------------

    def routes(self) -> list[tuple[str, str, Handler]]:
        # With runtime LoRA updating off the adapter routes do not exist: the server's own 404.
        load, unload = (
            (self._load, self._unload) if self.runtime_lora_updating else (_absent, _absent)
        )
        return [
            ("POST", "/v1/load_lora_adapter", load),
            ("POST", "/v1/unload_lora_adapter", unload),
            ("POST", "/v1/completions", self._completion),
            ("POST", "/v1/chat/completions", self._chat),
            ("GET", "/metrics", self._metrics),
        ]

    def fault_reply(self, op: EngineOp, kind: FaultKind, message: str) -> httpx.Response:
        if kind is FaultKind.OK_BUT_FAILED:
            return httpx.Response(
                200, json={"error": {"message": message, "type": "InternalServerError"}}
            )
        if kind is FaultKind.REFUSE:
            return _error(400, message, "InvalidUserInput")
        return _error(500, message, "InternalServerError")

    def base_model_root(self) -> str:
        return "/models/base"

    def restart(self) -> None:
        """The engine process restarts: it forgets every adapter and every request."""
        super().restart()
        self._running.clear()
        self._reports.clear()

    def register(self, lora_name: str, lora_path: str) -> None:
        """Register an adapter behind the backend's back (as another client would)."""
        digest = self.read_digest(lora_path)
        assert digest is not None, lora_path
        self.adapters[lora_name] = HeldAdapter(lora_name, lora_path, digest)
        self.physical_loads[lora_name] += 1

    def forget(self, lora_name: str) -> None:
        """Lose an adapter without a restart (as an operator's manual unload would)."""
        self.adapters.pop(lora_name)

    def start_request(self, lora_name: str) -> None:
        """A long request on ``lora_name`` is accepted and runs until :meth:`finish_request`."""
        assert lora_name in self.adapters, lora_name
        self._running[lora_name] += 1
        self._report()

    def finish_request(self, lora_name: str) -> None:
        """One request on ``lora_name`` finishes (whether or not the name is still registered)."""
        assert self._running[lora_name] > 0, lora_name
        self._running[lora_name] -= 1
        self._report()

    @property
    def process_start_time(self) -> float:
        """This boot's ``process_start_time_seconds``."""
        return 1_700_000_000.25 + 60.0 * self.restarts

    # --- handlers -----------------------------------------------------------------------------

    async def _load(self, request: httpx.Request) -> httpx.Response:
        body, fault = await self._enter(EngineOp.LOAD, request)
        name, path = str(body.get("lora_name") or ""), str(body.get("lora_path") or "")
        if not name or not path:
            return _error(
                400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput"
            )
        if name in self.adapters and not body.get("load_inplace"):
            return _error(
                400,
                f"The lora adapter '{name}' has already been loaded. If you want to load the "
                "adapter in place, set 'load_inplace' to True.",
                "InvalidUserInput",
            )
        digest = self.read_digest(path)
        if digest is None:
            return _error(
                404, f"Loading lora {name} failed: No adapter found for {path}", "NotFoundError"
            )
        self.adapters[name] = HeldAdapter(name, path, digest)
        self.physical_loads[name] += 1
        reply = httpx.Response(200, text=f"Success: LoRA adapter '{name}' added successfully.")
        return self._finish(fault, request, reply)

    async def _unload(self, request: httpx.Request) -> httpx.Response:
        body, fault = await self._enter(EngineOp.UNLOAD, request)
        name = str(body.get("lora_name") or "")
        if name not in self.adapters:
            return _error(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        # Forgotten at once; requests already running on it keep running (no refcount wait).
        del self.adapters[name]
        self.physical_unloads[name] += 1
        reply = httpx.Response(200, text=f"Success: LoRA adapter '{name}' removed successfully.")
        return self._finish(fault, request, reply)

    async def _completion(self, request: httpx.Request) -> httpx.Response:
        return await self._generation(EngineOp.COMPLETION, request)

    async def _chat(self, request: httpx.Request) -> httpx.Response:
        return await self._generation(EngineOp.CHAT, request)

    async def _generation(self, op: EngineOp, request: httpx.Request) -> httpx.Response:
        body, fault = await self._enter(op, request)
        model = str(body.get("model"))
        if model != self.served_model_name and model not in self.adapters:
            return _error(
                404,
                f"The model `{model}` does not exist. Valid aliases: {self.served_model_name}.",
                "NotFoundError",
            )
        if body.get("stream"):
            stream = self.streams.popleft() if self.streams else ScriptedStream()
            if stream.chunks is None:
                stream.chunks = openai_chunks(3, str(request.url.path), model)
            self.streamed.append(stream)
            return self._finish(fault, request, stream_reply(stream))
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
        if op is EngineOp.CHAT:
            choice["message"] = {"role": "assistant", "content": "x"}
        else:
            choice["text"] = "x"
        reply = httpx.Response(
            200,
            json={
                "object": "chat.completion" if op is EngineOp.CHAT else "text_completion",
                "model": model,
                "choices": [choice],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            },
        )
        return self._finish(fault, request, reply)

    async def _metrics(self, request: httpx.Request) -> httpx.Response:
        _, fault = await self._enter(EngineOp.METRICS, request)
        lines = [
            "# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.",
            "# TYPE process_start_time_seconds gauge",
            f"process_start_time_seconds {self.process_start_time!r}",
        ]
        if self._reports:
            lines += [
                "# HELP vllm:lora_requests_info Running stats on lora requests.",
                "# TYPE vllm:lora_requests_info gauge",
            ]
            for running, at in self._reports:
                names = ",".join(sorted(running))
                lines.append(
                    f'vllm:lora_requests_info{{max_lora="3",running_lora_adapters="{names}",'
                    f'waiting_lora_adapters=""}} {at!r}'
                )
        text = "\n".join(lines) + "\n"
        return self._finish(fault, request, httpx.Response(200, text=text))

    def _report(self) -> None:
        # Like vLLM: one sample per distinct label set, stamped with the time of its last report.
        self._clock += 1.0
        running = frozenset(n for n, c in self._running.items() if c > 0)
        self._reports = [(r, t) for r, t in self._reports if r != running]
        self._reports.append((running, 1_700_000_000.0 + self._clock))
