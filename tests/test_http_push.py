"""The HTTP push backend against scripted SGLang engines (respx)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
import respx
from agentic_lora_http import HttpPushBackend

from agentic_lora.backends import Backend, EngineRef, PublicationTarget
from agentic_lora.errors import (
    BackendAmbiguousError,
    BackendRefusedError,
    ConfigurationError,
)
from agentic_lora.identity import make_lora_name
from agentic_lora.testing.adapters import tiny_snapshot
from agentic_lora.testing.sglang_engine import EngineOp, Fault, FaultKind, ScriptedSGLangEngine

A = tiny_snapshot(1)
B = tiny_snapshot(2)
NAME_A = make_lora_name("policy_lora", 0, "v1", A.digest)
TARGET_A = PublicationTarget("v1", A.digest, NAME_A, 1)


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


def test_it_is_a_backend(tmp_path: Path) -> None:
    assert isinstance(HttpPushBackend(tmp_path), Backend)


@pytest.mark.asyncio
async def test_prepare_stores_loads_pinned_and_probes_the_exact_name(fleet: Fleet) -> None:
    receipt = await fleet.backend.prepare(fleet.ref0, TARGET_A, A)
    stored = fleet.store / "e0" / NAME_A
    load = [body for op, body in fleet.e0.calls if op is EngineOp.LOAD]
    assert load == [{"lora_name": NAME_A, "lora_path": str(stored), "pinned": True}]
    probes = [body for op, body in fleet.e0.calls if op is EngineOp.GENERATE]
    assert [p["lora_path"] for p in probes] == [NAME_A]
    assert fleet.e0.held_digest(NAME_A) == A.digest  # the engine read our bytes
    assert fleet.e0.adapters[NAME_A].pinned
    assert (
        receipt.engine,
        receipt.version_id,
        receipt.digest,
        receipt.lora_name,
        receipt.attempt,
    ) == (
        "e0",
        "v1",
        A.digest,
        NAME_A,
        1,
    )
    assert receipt.incarnation == await fleet.backend.incarnation(fleet.ref0)


@pytest.mark.asyncio
async def test_a_repeated_prepare_never_loads_twice(fleet: Fleet) -> None:
    first = await fleet.backend.prepare(fleet.ref0, TARGET_A, A)
    second = await fleet.backend.prepare(fleet.ref0, TARGET_A, A)
    assert first == second
    assert fleet.e0.physical_loads[NAME_A] == 1
    assert fleet.e0.count(EngineOp.LOAD) == 1


@pytest.mark.asyncio
async def test_http_200_with_success_false_is_refused_and_nothing_is_held(fleet: Fleet) -> None:
    fleet.e0.script(EngineOp.LOAD, Fault(FaultKind.OK_BUT_FAILED, "cannot pin"))
    with pytest.raises(BackendRefusedError, match="cannot pin"):
        await fleet.backend.prepare(fleet.ref0, TARGET_A, A)
    assert not fleet.e0.holds(NAME_A)


@pytest.mark.asyncio
async def test_a_lost_load_reply_is_ambiguous_and_cleanup_resolves_it(fleet: Fleet) -> None:
    fleet.e0.script(EngineOp.LOAD, Fault(FaultKind.LOSE_REPLY))
    with pytest.raises(BackendAmbiguousError):
        await fleet.backend.prepare(fleet.ref0, TARGET_A, A)
    assert fleet.e0.holds(NAME_A)  # it did load: the reply was lost, not the work
    await fleet.backend.cleanup(fleet.ref0, TARGET_A)
    assert not fleet.e0.holds(NAME_A)
    assert fleet.e0.physical_unloads[NAME_A] == 1
    assert not (fleet.store / "e0" / NAME_A).exists()


@pytest.mark.asyncio
async def test_a_probe_that_fails_after_the_load_is_ambiguous(fleet: Fleet) -> None:
    fleet.e0.script(EngineOp.GENERATE, Fault(FaultKind.SERVER_ERROR))
    with pytest.raises(BackendAmbiguousError, match="does not serve"):
        await fleet.backend.prepare(fleet.ref0, TARGET_A, A)
    assert fleet.e0.holds(NAME_A)


@pytest.mark.asyncio
async def test_an_unreachable_engine_refuses_before_anything_is_loaded(fleet: Fleet) -> None:
    fleet.e0.script(EngineOp.SERVER_INFO, Fault(FaultKind.UNREACHABLE))
    with pytest.raises(BackendRefusedError, match="unreadable"):
        await fleet.backend.prepare(fleet.ref0, TARGET_A, A)
    assert fleet.e0.count(EngineOp.LOAD) == 0


@pytest.mark.asyncio
async def test_a_snapshot_that_is_not_the_target_is_refused_without_io(fleet: Fleet) -> None:
    with pytest.raises(BackendRefusedError, match="digest"):
        await fleet.backend.prepare(fleet.ref0, TARGET_A, B)
    assert fleet.e0.calls == []


@pytest.mark.asyncio
async def test_a_stored_copy_with_other_content_is_refused_before_loading(fleet: Fleet) -> None:
    B.write_peft_dir(fleet.store / "e0" / NAME_A)  # wrong bytes under A's name
    with pytest.raises(BackendRefusedError) as info:
        await fleet.backend.prepare(fleet.ref0, TARGET_A, A)
    assert info.value.details["reason"] == "manifest_mismatch"
    assert fleet.e0.calls == []


@pytest.mark.asyncio
async def test_cleanup_of_an_absent_adapter_is_confirmed(fleet: Fleet) -> None:
    await fleet.backend.cleanup(fleet.ref0, TARGET_A)
    assert fleet.e0.count(EngineOp.UNLOAD) == 1
    assert fleet.e0.physical_unloads[NAME_A] == 0


@pytest.mark.asyncio
async def test_a_cleanup_that_overtook_its_prepare_fences_it(fleet: Fleet) -> None:
    await fleet.backend.cleanup(fleet.ref0, TARGET_A)
    with pytest.raises(BackendRefusedError, match="fenced"):
        await fleet.backend.prepare(fleet.ref0, TARGET_A, A)
    assert fleet.e0.count(EngineOp.LOAD) == 0
    assert not (fleet.store / "e0" / NAME_A).exists()
    # The next attempt is a new publication and goes through.
    retry = PublicationTarget("v1", A.digest, NAME_A, 2)
    assert (await fleet.backend.prepare(fleet.ref0, retry, A)).attempt == 2


@pytest.mark.asyncio
async def test_a_late_cleanup_of_a_superseded_attempt_touches_nothing(fleet: Fleet) -> None:
    await fleet.backend.prepare(fleet.ref0, PublicationTarget("v1", A.digest, NAME_A, 2), A)
    await fleet.backend.cleanup(fleet.ref0, TARGET_A)  # attempt 1, arriving late
    assert fleet.e0.holds(NAME_A)
    assert fleet.e0.count(EngineOp.UNLOAD) == 0
    assert (fleet.store / "e0" / NAME_A).is_dir()


@pytest.mark.asyncio
async def test_an_unload_that_fails_leaves_cleanup_unconfirmed(fleet: Fleet) -> None:
    await fleet.backend.prepare(fleet.ref0, TARGET_A, A)
    fleet.e0.script(EngineOp.UNLOAD, Fault(FaultKind.REFUSE, "rank 1 failed"))
    with pytest.raises(BackendAmbiguousError, match="not confirmed"):
        await fleet.backend.cleanup(fleet.ref0, TARGET_A)
    assert fleet.e0.holds(NAME_A)
    assert (fleet.store / "e0" / NAME_A).is_dir()


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
    assert fleet.e0.physical_unloads[NAME_A] == 1
    assert not (fleet.store / "e0" / NAME_A).exists()


@pytest.mark.asyncio
async def test_a_reclaim_retried_after_a_lost_receipt_never_unloads_twice(fleet: Fleet) -> None:
    await fleet.backend.prepare(fleet.ref0, TARGET_A, A)
    fleet.e0.script(EngineOp.UNLOAD, Fault(FaultKind.LOSE_REPLY))
    with pytest.raises(BackendAmbiguousError):
        await fleet.backend.reclaim(fleet.ref0, lora_name=NAME_A, reclaim_id="r1")
    await fleet.backend.reclaim(fleet.ref0, lora_name=NAME_A, reclaim_id="r1")
    await fleet.backend.reclaim(fleet.ref0, lora_name=NAME_A, reclaim_id="r1")
    assert fleet.e0.physical_unloads[NAME_A] == 1
    # Lost one, retried once (found absent); the third call was answered from memory.
    assert fleet.e0.count(EngineOp.UNLOAD) == 2


@pytest.mark.asyncio
async def test_a_reclaimed_name_cannot_be_resurrected(fleet: Fleet) -> None:
    await fleet.backend.prepare(fleet.ref0, TARGET_A, A)
    await fleet.backend.reclaim(fleet.ref0, lora_name=NAME_A, reclaim_id="r1")
    # A late request would make SGLang reload it from its cached path: that path is gone.
    async with httpx.AsyncClient() as client:
        late = await client.post(
            f"{fleet.e0.base_url}/generate", json={"input_ids": [0], "lora_path": NAME_A}
        )
    assert late.status_code == 400
    assert fleet.e0.implicit_reloads[NAME_A] == 0
    with pytest.raises(BackendRefusedError, match="fenced"):
        await fleet.backend.prepare(fleet.ref0, PublicationTarget("v1", A.digest, NAME_A, 2), A)


@pytest.mark.asyncio
async def test_incarnation_is_stable_and_changes_on_restart(fleet: Fleet) -> None:
    first = await fleet.backend.incarnation(fleet.ref0)
    assert await fleet.backend.incarnation(fleet.ref0) == first
    fleet.e0.restart()
    assert await fleet.backend.incarnation(fleet.ref0) != first


@pytest.mark.asyncio
async def test_a_loaded_adapter_that_vanished_counts_as_a_restart(fleet: Fleet) -> None:
    receipt = await fleet.backend.prepare(fleet.ref0, TARGET_A, A)
    # Same fingerprint (e.g. pinned seed, no startup_time), but the adapter is gone.
    del fleet.e0.adapters[NAME_A]
    after = await fleet.backend.incarnation(fleet.ref0)
    assert after != receipt.incarnation
    assert await fleet.backend.incarnation(fleet.ref0) == after


@pytest.mark.asyncio
async def test_unloading_ourselves_is_not_a_restart(fleet: Fleet) -> None:
    receipt = await fleet.backend.prepare(fleet.ref0, TARGET_A, A)
    await fleet.backend.cleanup(fleet.ref0, TARGET_A)
    assert await fleet.backend.incarnation(fleet.ref0) == receipt.incarnation


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


def test_store_root_must_be_absolute() -> None:
    with pytest.raises(ConfigurationError):
        HttpPushBackend("relative/store")


@pytest.mark.asyncio
async def test_engine_names_must_be_directory_names(fleet: Fleet) -> None:
    with pytest.raises(ConfigurationError):
        await fleet.backend.prepare(EngineRef("../e0", fleet.e0.base_url), TARGET_A, A)
