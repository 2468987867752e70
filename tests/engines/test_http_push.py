"""The HTTP push backend against scripted SGLang engines (respx): what only it does (a pinned load,
SGLang's own drain on unload, implicit reloads, the older server-info route). What every HTTP
backend does alike is in ``test_push_backends.py``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio
import respx
from agentic_lora_http import HttpPushBackend

from agentic_lora.engines.backends import EngineRef
from agentic_lora.testing.sglang_engine import EngineOp
from agentic_lora.testing.sglang_engine import ScriptedSGLangEngine
from tests.engines.test_push_backends import NAME_A
from tests.engines.test_push_backends import TARGET_A
from tests.engines.test_push_backends import A
from tests.engines.test_push_backends import assert_unloaded_once


@dataclass
class Fleet:
    backend: HttpPushBackend
    e0: ScriptedSGLangEngine
    ref0: EngineRef
    store: Path


@pytest_asyncio.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[Fleet]:
    engine = ScriptedSGLangEngine("e0", "http://127.0.0.1:31000")
    with respx.mock(assert_all_called=False) as router:
        engine.mount(router)
        backend = HttpPushBackend(tmp_path / "store")
        yield Fleet(backend, engine, EngineRef("e0", engine.base_url), tmp_path / "store")
        await backend.aclose()


@pytest.mark.asyncio
async def test_prepare_loads_pinned_and_probes_the_exact_name(fleet: Fleet) -> None:
    # The receipt and the stored bytes: test_push_backends.py. Here: SGLang's own request shapes.
    await fleet.backend.prepare(fleet.ref0, TARGET_A, A)
    stored = fleet.store / "e0" / NAME_A
    load = fleet.e0.bodies(EngineOp.LOAD)
    assert load == [{"lora_name": NAME_A, "lora_path": str(stored), "pinned": True}]
    assert [p["lora_path"] for p in fleet.e0.bodies(EngineOp.GENERATE)] == [NAME_A]
    assert fleet.e0.adapters[NAME_A].pinned


@pytest.mark.asyncio
async def test_reclaim_waits_for_in_flight_requests_then_unloads_once(fleet: Fleet) -> None:
    await fleet.backend.prepare(fleet.ref0, TARGET_A, A)
    request = fleet.e0.acquire(NAME_A)
    reclaim = asyncio.create_task(
        fleet.backend.reclaim(fleet.ref0, lora_name=NAME_A, reclaim_id="r1")
    )
    await fleet.e0.unload_blocked.wait()
    # Unregistered (no new request can acquire it) but not unloaded while a request runs.
    assert not reclaim.done()
    assert not fleet.e0.holds(NAME_A)
    assert fleet.e0.physical_unloads[NAME_A] == 0
    await fleet.e0.release(request)
    await reclaim
    assert_unloaded_once(fleet.e0, fleet.store, NAME_A)


@pytest.mark.asyncio
async def test_older_engines_answer_on_get_server_info(tmp_path: Path) -> None:
    engine = ScriptedSGLangEngine("e0", "http://127.0.0.1:31000", legacy_server_info=True)
    with respx.mock(assert_all_called=False) as router:
        engine.mount(router)
        backend = HttpPushBackend(tmp_path)
        try:
            receipt = await backend.prepare(EngineRef("e0", engine.base_url), TARGET_A, A)
        finally:
            await backend.aclose()
    assert receipt.incarnation
