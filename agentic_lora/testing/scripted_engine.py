"""What every scripted engine shares: scripted faults, the call record, respx mounting, model cards.

A scripted engine stands in for one real engine's HTTP surface, served through ``respx``. Each
engine kind (:mod:`~agentic_lora.testing.sglang_engine`,
:mod:`~agentic_lora.testing.vllm_engine`) subclasses :class:`ScriptedEngine` with its routes,
its adapter rules and the bodies its failures carry.

Faults are scripted per operation (:class:`EngineOp`) with :meth:`ScriptedEngine.script`, one
per future call, so a test decides exactly which call fails and how (refuse, answer 200 with a
failure body, act but lose the reply, be unreachable, wait on an :class:`asyncio.Event`, restart
after acting). Each engine kind serves some of the operations (:attr:`ScriptedEngine.ops`);
scripting or counting one it does not serve is a
:class:`~agentic_lora.errors.ConfigurationError`, never a fault that silently never strikes.
Everything is deterministic: no clocks, no randomness, no sleeps.
"""

from __future__ import annotations

import abc
import asyncio
import enum
import json
from collections import Counter
from collections import deque
from collections.abc import Awaitable
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field
from typing import Any
from typing import ClassVar
from typing import Generic
from typing import TypeVar

import httpx

from agentic_lora.errors import ConfigurationError

__all__ = ["COMMON_OPS", "EngineOp", "Fault", "FaultKind", "HeldAdapter", "ScriptedEngine"]


class EngineOp(enum.StrEnum):
    """Every engine call a fault can be scripted for, of every engine kind."""

    LOAD = "load"  # load an adapter (every kind)
    UNLOAD = "unload"  # unload an adapter (every kind)
    MODELS = "models"  # GET /v1/models (every kind)
    GENERATE = "generate"  # SGLang: POST /generate
    SERVER_INFO = "server_info"  # SGLang: GET /server_info or /get_server_info
    ABORT = "abort"  # SGLang: POST /abort_request
    COMPLETION = "completion"  # vLLM: POST /v1/completions
    CHAT = "chat"  # vLLM: POST /v1/chat/completions
    METRICS = "metrics"  # vLLM: GET /metrics


COMMON_OPS: frozenset[EngineOp] = frozenset({EngineOp.LOAD, EngineOp.UNLOAD, EngineOp.MODELS})
"""The operations every engine kind serves: what a backend's prepare and reclaim call, and
``GET /v1/models`` (served by :class:`ScriptedEngine` itself)."""


class FaultKind(enum.StrEnum):
    REFUSE = "refuse"  # HTTP 400, failure body; nothing done
    OK_BUT_FAILED = "ok_but_failed"  # HTTP 200 with a failure body; nothing done
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


@dataclass(frozen=True, slots=True)
class HeldAdapter:
    """What every scripted engine records about an adapter it serves: where it was read from
    and what it holds."""

    lora_name: str
    lora_path: str
    digest: str | None


AdapterT = TypeVar("AdapterT", bound=HeldAdapter)

Handler = Callable[[httpx.Request], Awaitable[httpx.Response]]


@dataclass
class ScriptedEngine(abc.ABC, Generic[AdapterT]):
    """One fake engine at ``base_url``; subclasses give the routes and the failure bodies."""

    name: str
    base_url: str
    served_model_name: str = "base-model"

    adapters: dict[str, AdapterT] = field(default_factory=dict)
    physical_loads: Counter[str] = field(default_factory=Counter)
    physical_unloads: Counter[str] = field(default_factory=Counter)
    calls: list[tuple[EngineOp, dict[str, Any]]] = field(default_factory=list)
    restarts: int = 0

    #: The operations this engine kind serves: :data:`COMMON_OPS` and its own.
    ops: ClassVar[frozenset[EngineOp]]

    def __post_init__(self) -> None:
        self.base_url = self.base_url.rstrip("/")
        self._faults: dict[EngineOp, deque[Fault]] = {op: deque() for op in self.ops}

    def _served(self, op: EngineOp) -> EngineOp:
        """``op``, refused unless this engine kind serves it: a fault scripted for a call the
        engine does not have would never strike, and a count of it would always be zero."""
        if op not in self.ops:
            raise ConfigurationError(
                f"a scripted {type(self).__name__} does not serve {op!r}",
                engine=self.name,
                op=str(op),
                served=sorted(self.ops),
            )
        return op

    # --- what a subclass provides -------------------------------------------------------------

    @abc.abstractmethod
    def routes(self) -> list[tuple[str, str, Handler]]:
        """``(method, path, handler)`` of every endpoint this engine serves but ``GET /v1/models``
        (served here, from :attr:`adapters`)."""

    @abc.abstractmethod
    def fault_reply(self, op: EngineOp, kind: FaultKind, message: str) -> httpx.Response:
        """The answer of ``op`` to a REFUSE, OK_BUT_FAILED or SERVER_ERROR fault, in the
        engine's words."""

    def base_model_root(self) -> str:
        """The ``root`` of the base model's card on ``/v1/models``."""
        return self.served_model_name

    # --- test controls ------------------------------------------------------------------------

    def mount(self, router: Any) -> None:
        """Route this engine's endpoints on a ``respx`` router (or the ``respx`` module)."""
        # Every engine lists its models (and adapters) the OpenAI way; the card shape is shared.
        routes = [*self.routes(), ("GET", "/v1/models", self._models)]
        for method, path, handler in routes:
            router.route(method=method, url=self.base_url + path).mock(
                side_effect=_answering(handler)
            )

    def script(self, op: EngineOp, *faults: Fault) -> None:
        """Queue faults for the next calls of ``op`` (one fault per call, in order).

        Raises :class:`~agentic_lora.errors.ConfigurationError` if this engine kind does not
        serve ``op``.
        """
        self._faults[self._served(op)].extend(faults)

    def clear_script(self) -> None:
        """Drop every scripted fault not consumed yet."""
        for queue in self._faults.values():
            queue.clear()

    def restart(self) -> None:
        """The engine process restarts: it forgets every adapter (subclasses forget the rest)."""
        self.restarts += 1
        self.adapters.clear()

    def holds(self, lora_name: str) -> bool:
        """Whether ``lora_name`` is registered (servable) right now."""
        return lora_name in self.adapters

    def held_digest(self, lora_name: str) -> str | None:
        """Digest of what the engine serves under ``lora_name`` (None: not registered)."""
        adapter = self.adapters.get(lora_name)
        return None if adapter is None else adapter.digest

    def count(self, op: EngineOp) -> int:
        """How many calls of ``op`` reached this engine (unreachable ones excluded); refused
        like :meth:`script` for an operation this engine kind does not serve."""
        self._served(op)
        return sum(1 for o, _ in self.calls if o is op)

    def bodies(self, op: EngineOp) -> list[dict[str, Any]]:
        """The JSON bodies of the calls of ``op`` that reached the engine, in order; refused
        like :meth:`script` for an operation this engine kind does not serve."""
        self._served(op)
        return [body for o, body in self.calls if o is op]

    # --- handler steps ------------------------------------------------------------------------

    async def _enter(
        self, op: EngineOp, request: httpx.Request
    ) -> tuple[dict[str, Any], Fault | None]:
        """Record the call and take its scripted fault; an unreachable engine records nothing.

        A fault that does nothing but answer ends the handler here (the route answers it); the
        fault returned, if any, is one that strikes after the engine acted (see :meth:`_finish`).
        """
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
        if fault is not None and fault.kind in _ANSWERED:
            raise _Answered(self.fault_reply(op, fault.kind, fault.message))
        return body, fault

    def _finish(
        self, fault: Fault | None, request: httpx.Request, response: httpx.Response
    ) -> httpx.Response:
        """Apply the faults that strike after the engine acted: a lost reply, a restart."""
        if fault is not None and fault.kind is FaultKind.LOSE_REPLY:
            raise httpx.ReadError("connection dropped before the reply (scripted)", request=request)
        if fault is not None and fault.kind is FaultKind.RESTART_AFTER:
            self.restart()
        return response

    async def _models(self, request: httpx.Request) -> httpx.Response:
        _, fault = await self._enter(EngineOp.MODELS, request)
        cards: list[dict[str, Any]] = [
            {
                "id": self.served_model_name,
                "object": "model",
                "root": self.base_model_root(),
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


_ANSWERED = frozenset({FaultKind.REFUSE, FaultKind.OK_BUT_FAILED, FaultKind.SERVER_ERROR})


class _Answered(Exception):
    """A scripted fault's answer, raised past the handler that met it."""

    def __init__(self, response: httpx.Response) -> None:
        super().__init__(response.status_code)
        self.response = response


def _answering(handler: Handler) -> Handler:
    """``handler`` answering the scripted faults that only answer (see ``_enter``)."""

    async def answer(request: httpx.Request) -> httpx.Response:
        try:
            return await handler(request)
        except _Answered as answered:
            return answered.response

    return answer
