"""The HTTP push backend passes the backend conformance suite against scripted SGLang engines."""

from __future__ import annotations

import shutil
import tempfile
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from agentic_lora_http import HttpPushBackend
from hypothesis import HealthCheck, settings

from agentic_lora.backends import Backend, EngineRef
from agentic_lora.testing.backend_conformance import (
    BackendConformance,
    EngineDouble,
    Failure,
    Operation,
)
from agentic_lora.testing.fleet import ScriptedFleet
from agentic_lora.testing.sglang_engine import EngineOp, Fault, FaultKind, ScriptedSGLangEngine

_ENGINE_OP = {
    Operation.PREPARE: EngineOp.LOAD,
    Operation.CLEANUP: EngineOp.UNLOAD,
    Operation.RECLAIM: EngineOp.UNLOAD,
}
_FAULT = {Failure.REFUSE: FaultKind.REFUSE, Failure.LOSE_REPLY: FaultKind.LOSE_REPLY}


class SGLangDouble:
    """A scripted SGLang engine seen through the suite's EngineDouble protocol."""

    def __init__(self, engine: ScriptedSGLangEngine) -> None:
        self.engine = engine
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
        self.engine.script(_ENGINE_OP[operation], Fault(_FAULT[failure]))

    def clear_failures(self) -> None:
        self.engine.clear_script()


class HttpHarness:
    def __init__(self) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="conformance-"))
        self._fleet = ScriptedFleet(("e0", "e1")).__enter__()
        self._backend = HttpPushBackend(self._dir / "store")
        self._doubles = [SGLangDouble(e) for e in self._fleet.engines.values()]

    @property
    def backend(self) -> Backend:
        return self._backend

    @property
    def engines(self) -> Sequence[EngineDouble]:
        return self._doubles

    async def aclose(self) -> None:
        try:
            await self._backend.aclose()
        finally:
            self._fleet.__exit__(None, None, None)
            shutil.rmtree(self._dir, ignore_errors=True)


class HttpPushConformance(BackendConformance):
    async def make_harness(self) -> HttpHarness:
        return HttpHarness()


HttpPushConformance.TestCase.settings = settings(
    max_examples=40,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestHttpPushConformance = HttpPushConformance.TestCase
