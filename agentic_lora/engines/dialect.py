"""The engine dialect contract: every rule that depends on which engine software serves the fleet.

A dialect says

* which routes exist (:attr:`EngineDialect.routes`, :meth:`EngineDialect.check_route`);
* how a request names its adapter (:meth:`EngineDialect.pin`);
* how a request is aborted by id (:meth:`EngineDialect.abort_request`; ``can_abort``);
* how a generation is asked to stream and how its events read (:meth:`EngineDialect.stream_body`,
  :meth:`EngineDialect.parse_stream_event`; see :mod:`agentic_lora.engines.sse`);
* how server info and the incarnation are read (:meth:`EngineDialect.read_server_info`,
  :meth:`EngineDialect.fingerprint`), through :class:`~agentic_lora.engines.wire.EngineHttp`, so the
  generation transport and the admin clients share one reader;
* whether unload waits for in-flight requests (``unload_waits_for_requests``; when it does not, a
  backend takes a drain hook under the option name :data:`DRAIN_OPTION`);
* how the engine's LoRA slot settings are checked (:meth:`EngineDialect.check_server_info`).

Dialects register under the entry-point group :data:`DIALECTS_GROUP` (``agentic_lora.engines``);
the settings' ``engine_kind`` names one. The shipped ones are ``sglang``
(:mod:`agentic_lora.engines.sglang`) and ``vllm`` (:mod:`agentic_lora_vllm.dialect`);
:func:`agentic_lora.testing.dialect_contract.check_dialect` is the contract every dialect passes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from typing import ClassVar
from typing import Protocol
from typing import runtime_checkable

from agentic_lora.engines.sse import StreamEvent
from agentic_lora.engines.sse import parse_event
from agentic_lora.engines.wire import EngineHttp
from agentic_lora.errors import AdapterMismatchError
from agentic_lora.errors import ConfigurationError
from agentic_lora.errors import InvalidRequestError
from agentic_lora.foundation.discovery import DIALECTS_GROUP
from agentic_lora.foundation.discovery import load_plugin
from agentic_lora.foundation.discovery import plugin_names
from agentic_lora.foundation.requests import Route

__all__ = [
    "DIALECTS_GROUP",
    "DRAIN_OPTION",
    "DialectBase",
    "EngineDialect",
    "SlotSettings",
    "check_lora_slots",
    "dialect_names",
    "load_dialect",
]

#: The backend option that takes a drain hook (``await wait_drained(lora_name)``), given by
#: :meth:`agentic_lora.assembly.deployment.Deployment.from_settings` when the dialect's unload does not
#: wait for in-flight requests.
DRAIN_OPTION = "wait_drained"


@dataclass(frozen=True, slots=True)
class SlotSettings:
    """What the settings say about the engines' LoRA slots (None: not declared)."""

    capacity: int
    max_loaded_loras: int | None = None
    max_loras_per_batch: int | None = None


def check_lora_slots(
    capacity: int, max_loaded: int | None, per_batch: int | None, *, source: str
) -> None:
    """Raise ConfigurationError unless the slots hold every managed version plus one free one."""
    if max_loaded is not None and max_loaded < capacity + 1:
        raise ConfigurationError(
            f"{source}: max_loaded_loras {max_loaded} < capacity + 1 = {capacity + 1} "
            "(every managed version plus one free slot)",
            check="engine_lora_slots",
            max_loaded_loras=max_loaded,
            capacity=capacity,
        )
    if per_batch is not None and per_batch - 1 < capacity:
        raise ConfigurationError(
            f"{source}: max_loras_per_batch {per_batch} leaves {per_batch - 1} pinnable slots, "
            f"fewer than capacity {capacity}",
            check="pinned_slots",
            max_loras_per_batch=per_batch,
            capacity=capacity,
        )


@runtime_checkable
class EngineDialect(Protocol):
    """Everything engine-specific (see module docstring). Stateless: one instance serves all."""

    @property
    def name(self) -> str:
        """The entry-point name (the ``engine_kind`` setting that picks this dialect)."""
        ...

    @property
    def routes(self) -> frozenset[Route]:
        """The generation routes the engine serves."""
        ...

    @property
    def can_abort(self) -> bool:
        """Whether a request can be aborted by id (else close waits for it to end)."""
        ...

    @property
    def unload_waits_for_requests(self) -> bool:
        """Whether unload waits for in-flight requests (else the backend needs a drain hook)."""
        ...

    def check_route(self, route: Route) -> None:
        """Raise InvalidRequestError (``reason="route_unsupported"``) unless ``route`` exists."""
        ...

    def pin(
        self, route: Route, body: Mapping[str, Any], lora_name: str, base_model: str | None
    ) -> dict[str, Any]:
        """``body`` naming exactly ``lora_name``; a caller that named another adapter raises
        AdapterMismatchError. The route is not checked here (the Session did, once, before it
        bound)."""
        ...

    def abort_request(self, rid: str) -> tuple[str, dict[str, Any]]:
        """``(path, body)`` of the POST that aborts request ``rid``; InvalidRequestError
        (``reason="abort_unsupported"``) when the engine cannot abort by id."""
        ...

    def stream_body(self, route: Route, body: Mapping[str, Any]) -> dict[str, Any]:
        """``body`` (already pinned) asking the engine to stream its answer on ``route``."""
        ...

    def parse_stream_event(self, payload: str) -> StreamEvent:
        """One ``data:`` payload of a streamed answer (a chunk, the engine's error, or the end)."""
        ...

    async def read_server_info(self, http: EngineHttp) -> Mapping[str, Any] | None:
        """The engine's server info, or None (without I/O) when the engine publishes none."""
        ...

    async def fingerprint(self, http: EngineHttp, base_url: str) -> str:
        """A short hash that changes on every restart of the engine process, never during it."""
        ...

    def check_server_info(
        self, info: Mapping[str, Any], *, engine: str, slots: SlotSettings
    ) -> None:
        """ConfigurationError (``engine_lora``, ``engine_lora_slots``, ``pinned_slots``) unless
        the engine runs with LoRA on and the slots ``slots`` needs."""
        ...


class DialectBase:
    """Route checking and the no-abort answer shared by the shipped dialects."""

    name: ClassVar[str]
    #: The engine's name as people write it (in refusals).
    label: ClassVar[str]
    routes: ClassVar[frozenset[Route]]
    can_abort: ClassVar[bool] = False
    unload_waits_for_requests: ClassVar[bool] = True
    #: Appended to the route refusal: what the caller should send instead.
    route_hint: ClassVar[str] = ""

    def check_route(self, route: Route) -> None:
        """Raise InvalidRequestError unless ``route`` is one of :attr:`routes`."""
        if route not in self.routes:
            raise InvalidRequestError(
                f"{self.label} engines have no {route.value} route{self.route_hint}; "
                "nothing was sent",
                route=route.value,
                engine_kind=self.name,
                reason="route_unsupported",
            )

    def stream_body(self, route: Route, body: Mapping[str, Any]) -> dict[str, Any]:
        """``body`` with ``"stream": true`` (both shipped engines stream every generation route
        as server-sent events; see :mod:`agentic_lora.engines.sse`)."""
        return {**body, "stream": True}

    def parse_stream_event(self, payload: str) -> StreamEvent:
        """:func:`agentic_lora.engines.sse.parse_event`: SGLang and vLLM share the format."""
        return parse_event(payload)

    def abort_request(self, rid: str) -> tuple[str, dict[str, Any]]:
        """InvalidRequestError: this engine has no route to abort a request by id."""
        raise InvalidRequestError(
            f"{self.label} engines have no route to abort a request by id; nothing was sent",
            rid=rid,
            engine_kind=self.name,
            reason="abort_unsupported",
        )

    @staticmethod
    def _check_lora_path(given_path: object, lora_name: str) -> None:
        """A ``lora_path`` the caller sent must name the bound adapter (AdapterMismatchError)."""
        if given_path is not None and given_path != lora_name:
            raise AdapterMismatchError(
                f"request names adapter {given_path!r} but this Session is bound to {lora_name!r}",
                given=given_path,
                bound=lora_name,
            )

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def dialect_names() -> tuple[str, ...]:
    """Names of the installed engine dialects, sorted."""
    return plugin_names(DIALECTS_GROUP)


def load_dialect(name: str) -> EngineDialect:
    """The dialect registered as ``name`` (ConfigurationError ``engine_kind`` if none is)."""
    factory = load_plugin(DIALECTS_GROUP, name)
    dialect = factory() if isinstance(factory, type) else factory
    if not isinstance(dialect, EngineDialect):
        raise ConfigurationError(
            f"engine dialect plugin {name!r} does not implement the EngineDialect protocol",
            check="engine_kind",
            name=name,
        )
    return dialect
