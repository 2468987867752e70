"""The scripted engines' operations: one enum, each engine kind serving its own calls."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import respx

from agentic_lora.errors import ConfigurationError
from agentic_lora.testing.scripted_engine import COMMON_OPS
from agentic_lora.testing.scripted_engine import EngineOp
from agentic_lora.testing.scripted_engine import Fault
from agentic_lora.testing.scripted_engine import FaultKind
from agentic_lora.testing.scripted_engine import ScriptedEngine
from agentic_lora.testing.sglang_engine import ScriptedSGLangEngine
from agentic_lora.testing.vllm_engine import ScriptedVllmEngine

KINDS: list[type[ScriptedEngine[Any]]] = [ScriptedSGLangEngine, ScriptedVllmEngine]


def test_every_operation_is_served_by_some_engine_kind_and_the_backend_calls_by_all() -> None:
    assert set(ScriptedSGLangEngine.ops | ScriptedVllmEngine.ops) == set(EngineOp)
    assert ScriptedSGLangEngine.ops & ScriptedVllmEngine.ops == COMMON_OPS
    assert {EngineOp.LOAD, EngineOp.UNLOAD, EngineOp.MODELS} == COMMON_OPS


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
def test_an_operation_the_engine_does_not_serve_is_refused_not_silently_scripted(
    kind: type[ScriptedEngine[Any]],
) -> None:
    engine = kind("e0", "http://127.0.0.1:31999")
    unserved = sorted(set(EngineOp) - kind.ops)
    assert unserved
    for op in unserved:
        with pytest.raises(ConfigurationError) as refused:
            engine.script(op, Fault(FaultKind.REFUSE))
        assert refused.value.code == "CONFIG_ERROR"
        assert refused.value.details == {"engine": "e0", "op": str(op), "served": sorted(kind.ops)}
        with pytest.raises(ConfigurationError):
            engine.count(op)
        with pytest.raises(ConfigurationError):
            engine.bodies(op)


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
async def test_a_served_operation_takes_its_scripted_fault(
    kind: type[ScriptedEngine[Any]],
) -> None:
    engine = kind("e0", "http://127.0.0.1:31999")
    engine.script(EngineOp.MODELS, Fault(FaultKind.SERVER_ERROR))
    with respx.mock(assert_all_called=False, assert_all_mocked=True) as router:
        engine.mount(router)
        async with httpx.AsyncClient() as client:
            first = await client.get(engine.base_url + "/v1/models")
            second = await client.get(engine.base_url + "/v1/models")
    assert (first.status_code, second.status_code) == (500, 200)
    assert engine.count(EngineOp.MODELS) == 2
