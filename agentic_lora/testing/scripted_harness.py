"""Scripted engines as the backend conformance suite sees them: one harness for every HTTP backend.

:class:`ScriptedHarness` is a :class:`~agentic_lora.testing.backend_conformance.ConformanceHarness`
made of a backend and scripted engines (:mod:`~agentic_lora.testing.sglang_engine`,
:mod:`~agentic_lora.testing.vllm_engine`) behind one ``respx`` router. A plugin that talks to
one of those engines over HTTP proves conformance with::

    class MyConformance(BackendConformance):
        async def make_harness(self) -> ScriptedHarness:
            return ScriptedHarness(MyBackend, sglang_engines())

    TestMyConformance = MyConformance.TestCase
"""

from __future__ import annotations

import shutil
import tempfile
from collections import Counter
from collections.abc import Callable
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import respx

from agentic_lora.engines.backends import Backend
from agentic_lora.engines.backends import EngineRef
from agentic_lora.testing.backend_conformance import BackendHarness
from agentic_lora.testing.backend_conformance import Failure
from agentic_lora.testing.backend_conformance import Operation
from agentic_lora.testing.scripted_engine import EngineOp
from agentic_lora.testing.scripted_engine import Fault
from agentic_lora.testing.scripted_engine import FaultKind
from agentic_lora.testing.scripted_engine import ScriptedEngine
from agentic_lora.testing.sglang_engine import ScriptedSGLangEngine
from agentic_lora.testing.vllm_engine import ScriptedVllmEngine

__all__ = [
    "ScriptedDouble",
    "ScriptedHarness",
    "sglang_engines",
    "vllm_engines",
]

_FAULT = {Failure.REFUSE: FaultKind.REFUSE, Failure.LOSE_REPLY: FaultKind.LOSE_REPLY}


def sglang_engines(names: Sequence[str] = ("e0", "e1"), base_port: int = 31000) -> list[Any]:
    """Scripted SGLang engines at ``127.0.0.1:<base_port + i>``."""
    return [
        ScriptedSGLangEngine(n, f"http://127.0.0.1:{base_port + i}") for i, n in enumerate(names)
    ]


def vllm_engines(names: Sequence[str] = ("e0", "e1"), base_port: int = 32000) -> list[Any]:
    """Scripted vLLM engines at ``127.0.0.1:<base_port + i>``."""
    return [ScriptedVllmEngine(n, f"http://127.0.0.1:{base_port + i}") for i, n in enumerate(names)]


class ScriptedDouble:
    """A scripted engine seen through the suite's :class:`EngineDouble` protocol.

    Load and unload counts are kept since the last :meth:`restart`, as the suite reads them.
    """

    def __init__(self, engine: ScriptedEngine[Any]) -> None:
        self.engine = engine
        self._op = {
            Operation.PREPARE: EngineOp.LOAD,
            Operation.CLEANUP: EngineOp.UNLOAD,
            Operation.RECLAIM: EngineOp.UNLOAD,
        }
        self._loads_at_boot: Counter[str] = Counter()
        self._unloads_at_boot: Counter[str] = Counter()

    @property
    def ref(self) -> EngineRef:
        return EngineRef(self.engine.name, self.engine.base_url)

    def held_digest(self, lora_name: str) -> str | None:
        return self.engine.held_digest(lora_name)

    def loads(self, lora_name: str) -> int:
        return self.engine.physical_loads[lora_name] - self._loads_at_boot[lora_name]

    def unloads(self, lora_name: str) -> int:
        return self.engine.physical_unloads[lora_name] - self._unloads_at_boot[lora_name]

    def restart(self) -> None:
        self.engine.restart()
        self._loads_at_boot = Counter(self.engine.physical_loads)
        self._unloads_at_boot = Counter(self.engine.physical_unloads)

    def fail_next(self, operation: Operation, failure: Failure) -> None:
        self.engine.script(self._op[operation], Fault(_FAULT[failure]))

    def clear_failures(self) -> None:
        self.engine.clear_script()


class ScriptedHarness(BackendHarness):
    """A backend built on a fresh store directory, over scripted engines routed by respx.

    ``make_backend`` gets the (absolute) store root. The router is entered at construction and
    left by :meth:`aclose`, which also removes the store.
    """

    def __init__(
        self,
        make_backend: Callable[[Path], Backend],
        engines: Sequence[ScriptedEngine[Any]],
    ) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="conformance-"))
        self._router = respx.mock(assert_all_called=False, assert_all_mocked=True)
        for engine in engines:
            engine.mount(self._router)
        self._router.__enter__()
        super().__init__(make_backend(self._dir / "store"), [ScriptedDouble(e) for e in engines])

    async def release(self) -> None:
        self._router.__exit__(None, None, None)
        shutil.rmtree(self._dir, ignore_errors=True)
