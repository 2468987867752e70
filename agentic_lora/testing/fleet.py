"""A fleet of scripted SGLang engines behind one respx router, for tests of whole flows."""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType
from typing import Any

import respx

from agentic_lora.config import AgenticLoRASettings
from agentic_lora.config import load_settings
from agentic_lora.engines.backends import EngineRef
from agentic_lora.testing.sglang_engine import EngineOp
from agentic_lora.testing.sglang_engine import ScriptedSGLangEngine

__all__ = ["ScriptedFleet"]


class ScriptedFleet:
    """``ScriptedSGLangEngine`` per name at ``127.0.0.1:<base_port + i>``, routed while entered.

    ``engine_type`` makes each engine (a subclass answering some route its own way).

    Use as a context manager (sync or async); every HTTP request made through ``httpx`` to one of
    the engines' URLs is answered by that engine, anything else fails loudly.
    """

    def __init__(
        self,
        names: Sequence[str] = ("e0", "e1"),
        *,
        base_port: int = 31000,
        engine_type: type[ScriptedSGLangEngine] = ScriptedSGLangEngine,
    ) -> None:
        self.engines: dict[str, ScriptedSGLangEngine] = {
            name: engine_type(name, f"http://127.0.0.1:{base_port + i}")
            for i, name in enumerate(names)
        }
        self.refs: tuple[EngineRef, ...] = tuple(
            EngineRef(e.name, e.base_url) for e in self.engines.values()
        )
        self.router = respx.mock(assert_all_called=False, assert_all_mocked=True)
        for engine in self.engines.values():
            engine.mount(self.router)

    def __getitem__(self, name: str) -> ScriptedSGLangEngine:
        return self.engines[name]

    def settings(self, *, capacity: int = 2, **overrides: Any) -> AgenticLoRASettings:
        """Settings of a Deployment on this fleet; ``overrides`` win.

        Versioned publication on, ``capacity`` versions with capacity + 1 LoRA slots per engine,
        the ``httpx`` transport (the one the fleet's routes intercept) and base model
        ``tiny-qwen3``.
        """
        values: dict[str, Any] = {
            "enable_versioned_lora_publication": True,
            "engines": [f"{e.name}={e.base_url}" for e in self.refs],
            "capacity": capacity,
            "http_transport": "httpx",
            "engine_max_loaded_loras": capacity + 1,
            "engine_max_loras_per_batch": capacity + 1,
            "base_model_name": "tiny-qwen3",
        }
        return load_settings(**{**values, **overrides})

    def calls(self, op: EngineOp | None = None) -> int:
        """Requests that reached any engine (of one operation, or all)."""
        return sum(len(e.calls) if op is None else e.count(op) for e in self.engines.values())

    def __enter__(self) -> ScriptedFleet:
        self.router.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.router.__exit__(exc_type, exc, tb)

    async def __aenter__(self) -> ScriptedFleet:
        return self.__enter__()

    async def __aexit__(self, *exc_info: Any) -> None:
        self.__exit__(*exc_info)
