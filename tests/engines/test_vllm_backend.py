"""The vLLM backend against a scripted vLLM 0.32.0 engine (respx): what only it does (the drain
hook, vLLM's error bodies and routes, metrics). What every HTTP backend does alike is in
``test_push_backends.py``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
import respx
from agentic_lora_vllm import VllmBackend
from agentic_lora_vllm.metrics import parse_metrics

from agentic_lora.engines.backends import EngineRef
from agentic_lora.errors import BackendAmbiguousError
from agentic_lora.errors import BackendError
from agentic_lora.errors import BackendRefusedError
from agentic_lora.errors import ConfigurationError
from agentic_lora.testing.vllm_engine import EngineOp
from agentic_lora.testing.vllm_engine import Fault
from agentic_lora.testing.vllm_engine import FaultKind
from agentic_lora.testing.vllm_engine import ScriptedVllmEngine
from tests.engines.test_push_backends import NAME_A
from tests.engines.test_push_backends import TARGET_A
from tests.engines.test_push_backends import A
from tests.engines.test_push_backends import assert_unloaded_once
from tests.engines.test_push_backends import drained_at_once


@dataclass
class DrainGate:
    """A drain hook the test opens by hand; records every name it was asked about."""

    asked: list[str] = field(default_factory=list)
    entered: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)

    async def __call__(self, lora_name: str) -> None:
        self.asked.append(lora_name)
        self.entered.set()
        await self.release.wait()


@dataclass
class Fleet:
    backend: VllmBackend
    e0: ScriptedVllmEngine
    ref0: EngineRef
    store: Path
    drain: DrainGate
    router: respx.MockRouter


@pytest_asyncio.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[Fleet]:
    engine = ScriptedVllmEngine("e0", "http://127.0.0.1:32000")
    drain = DrainGate()
    drain.release.set()
    with respx.mock(assert_all_called=False) as router:
        engine.mount(router)
        backend = VllmBackend(tmp_path / "store", wait_drained=drain)
        ref = EngineRef("e0", engine.base_url)
        yield Fleet(backend, engine, ref, tmp_path / "store", drain, router)
        await backend.aclose()


@pytest_asyncio.fixture
async def no_runtime_updates(tmp_path: Path) -> AsyncIterator[tuple[VllmBackend, EngineRef]]:
    """An engine started without ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``: no load or unload route."""
    engine = ScriptedVllmEngine("e0", "http://127.0.0.1:32000", runtime_lora_updating=False)
    with respx.mock(assert_all_called=False) as router:
        engine.mount(router)
        backend = VllmBackend(tmp_path, wait_drained=drained_at_once)
        yield backend, EngineRef("e0", engine.base_url)
        await backend.aclose()


# --- construction ---------------------------------------------------------------------------


def test_a_drain_hook_that_is_not_callable_is_a_configuration_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError) as info:
        VllmBackend(tmp_path, wait_drained=None)  # type: ignore[arg-type]
    assert info.value.details["check"] == "vllm_drain_hook"


# --- prepare: success -----------------------------------------------------------------------


@pytest.mark.asyncio
async def test_prepare_registers_and_probes_the_exact_name(fleet: Fleet) -> None:
    # The receipt and the stored bytes: test_push_backends.py. Here: vLLM's own request shapes.
    await fleet.backend.prepare(fleet.ref0, TARGET_A, A)
    stored = fleet.store / "e0" / NAME_A
    # Exactly name and path: never load_inplace, and vLLM has no pinned flag.
    assert fleet.e0.bodies(EngineOp.LOAD) == [{"lora_name": NAME_A, "lora_path": str(stored)}]
    probes = fleet.e0.bodies(EngineOp.COMPLETION)
    assert [(p["model"], p["max_tokens"], p["temperature"]) for p in probes] == [(NAME_A, 1, 0.0)]


# --- prepare: clean refusals ----------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("kind", "error", "status"),
    [
        (FaultKind.REFUSE, BackendRefusedError, 400),
        # HTTP 200 with an error body is a refusal, not a success.
        (FaultKind.OK_BUT_FAILED, BackendRefusedError, 200),
        # A server error may come after the engine acted: ambiguous.
        (FaultKind.SERVER_ERROR, BackendAmbiguousError, 500),
    ],
)
async def test_a_failed_load_is_classified_by_its_answer_and_never_probed(
    fleet: Fleet, kind: FaultKind, error: type[BackendError], status: int
) -> None:
    fleet.e0.script(EngineOp.LOAD, Fault(kind, "rank too large"))
    with pytest.raises(error, match="rank too large") as info:
        await fleet.backend.prepare(fleet.ref0, TARGET_A, A)
    assert info.value.details["status"] == status
    assert fleet.e0.held_digest(NAME_A) is None
    assert fleet.e0.count(EngineOp.COMPLETION) == 0  # never probed, never reported READY


@pytest.mark.asyncio
async def test_a_load_that_never_connected_is_refused(fleet: Fleet) -> None:
    fleet.e0.script(EngineOp.LOAD, Fault(FaultKind.UNREACHABLE))
    with pytest.raises(BackendRefusedError, match="ConnectError"):
        await fleet.backend.prepare(fleet.ref0, TARGET_A, A)
    assert fleet.e0.held_digest(NAME_A) is None


@pytest.mark.asyncio
async def test_runtime_lora_updating_off_is_a_refusal_naming_the_route(
    no_runtime_updates: tuple[VllmBackend, EngineRef],
) -> None:
    backend, ref = no_runtime_updates
    with pytest.raises(BackendRefusedError, match="Not Found") as info:
        await backend.prepare(ref, TARGET_A, A)
    assert info.value.details["status"] == 404


# --- prepare: ambiguous outcomes ------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_refusal_while_the_engine_lists_the_name_is_ambiguous(fleet: Fleet) -> None:
    gate, reached = asyncio.Event(), asyncio.Event()
    fleet.e0.script(EngineOp.LOAD, Fault.waiting_for(gate, reached))
    prepare = asyncio.create_task(fleet.backend.prepare(fleet.ref0, TARGET_A, A))
    await reached.wait()
    # Another client registers the same name at the same path while our load is in transit:
    # the engine answers "already loaded", yet it does hold the name.
    fleet.e0.register(NAME_A, str(fleet.store / "e0" / NAME_A))
    gate.set()
    with pytest.raises(BackendAmbiguousError, match="refused to load") as info:
        await prepare
    assert info.value.details["reason"] == "refused_but_held"


@pytest.mark.asyncio
async def test_a_200_that_is_neither_success_nor_error_is_ambiguous(fleet: Fleet) -> None:
    # Same method and URL as the engine's own route: respx replaces it.
    fleet.router.post(f"{fleet.e0.base_url}/v1/load_lora_adapter").respond(200, text="maybe")
    with pytest.raises(BackendAmbiguousError, match="neither success nor error"):
        await fleet.backend.prepare(fleet.ref0, TARGET_A, A)


@pytest.mark.asyncio
async def test_a_success_the_listing_does_not_confirm_is_ambiguous(fleet: Fleet) -> None:
    # Same method and URL as the engine's own route: respx replaces it.
    fleet.router.post(f"{fleet.e0.base_url}/v1/load_lora_adapter").respond(
        200, text=f"Success: LoRA adapter '{NAME_A}' added successfully."
    )
    with pytest.raises(BackendAmbiguousError) as info:
        await fleet.backend.prepare(fleet.ref0, TARGET_A, A)
    assert info.value.details["reason"] == "load_unconfirmed"


@pytest.mark.asyncio
async def test_a_probe_answered_by_another_model_is_ambiguous(fleet: Fleet) -> None:
    # Same method and URL as the engine's own route: respx replaces it.
    fleet.router.post(f"{fleet.e0.base_url}/v1/completions").respond(
        200, json={"model": "base-model", "choices": [{"text": "x", "finish_reason": "length"}]}
    )
    with pytest.raises(BackendAmbiguousError, match="base-model"):
        await fleet.backend.prepare(fleet.ref0, TARGET_A, A)


@pytest.mark.asyncio
async def test_a_name_held_at_another_path_is_ambiguous_and_not_reloaded(fleet: Fleet) -> None:
    elsewhere = fleet.store / "elsewhere"
    A.write_peft_dir(elsewhere)
    fleet.e0.register(NAME_A, str(elsewhere))
    with pytest.raises(BackendAmbiguousError, match="already holds"):
        await fleet.backend.prepare(fleet.ref0, TARGET_A, A)
    assert fleet.e0.count(EngineOp.LOAD) == 0


# --- cleanup --------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_cleanup_unloads_and_removes_the_directory_without_a_drain(fleet: Fleet) -> None:
    await fleet.backend.prepare(fleet.ref0, TARGET_A, A)
    await fleet.backend.cleanup(fleet.ref0, TARGET_A)
    assert fleet.e0.held_digest(NAME_A) is None
    assert not (fleet.store / "e0" / NAME_A).exists()
    assert fleet.drain.asked == []  # a failed publication had no Sessions to drain


@pytest.mark.asyncio
async def test_a_missing_unload_route_is_never_taken_for_an_absent_adapter(
    no_runtime_updates: tuple[VllmBackend, EngineRef],
) -> None:
    backend, ref = no_runtime_updates
    with pytest.raises(BackendAmbiguousError, match="not confirmed"):
        await backend.cleanup(ref, TARGET_A)


# --- reclaim --------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_reclaim_waits_for_the_drain_hook_before_unloading(fleet: Fleet) -> None:
    await fleet.backend.prepare(fleet.ref0, TARGET_A, A)
    fleet.drain.release.clear()
    reclaim = asyncio.create_task(
        fleet.backend.reclaim(fleet.ref0, lora_name=NAME_A, reclaim_id="r1")
    )
    entered = asyncio.create_task(fleet.drain.entered.wait())
    done, _ = await asyncio.wait({reclaim, entered}, return_when=asyncio.FIRST_COMPLETED)
    assert reclaim not in done, "reclaim finished without waiting for the drain"
    assert entered in done
    # Requests may still be running on A: vLLM would forget the name at once and a later reload
    # of an evicted adapter would need the directory, so nothing is touched yet.
    assert fleet.drain.asked == [NAME_A]
    assert fleet.e0.count(EngineOp.UNLOAD) == 0
    assert fleet.e0.held_digest(NAME_A) == A.digest
    assert (fleet.store / "e0" / NAME_A).is_dir()
    fleet.drain.release.set()
    await reclaim
    assert_unloaded_once(fleet.e0, fleet.store, NAME_A)


@pytest.mark.asyncio
async def test_reclaim_is_not_confirmed_while_the_engine_reports_requests(fleet: Fleet) -> None:
    await fleet.backend.prepare(fleet.ref0, TARGET_A, A)
    fleet.e0.start_request(NAME_A)  # e.g. a request whose client gave up, still running
    with pytest.raises(BackendAmbiguousError, match="still reports requests") as info:
        await fleet.backend.reclaim(fleet.ref0, lora_name=NAME_A, reclaim_id="r1")
    assert info.value.details["reason"] == "engine_busy"
    assert fleet.e0.count(EngineOp.UNLOAD) == 0
    assert (fleet.store / "e0" / NAME_A).is_dir()
    fleet.e0.finish_request(NAME_A)
    await fleet.backend.reclaim(fleet.ref0, lora_name=NAME_A, reclaim_id="r1")
    assert fleet.e0.physical_unloads[NAME_A] == 1


@pytest.mark.asyncio
async def test_a_failing_drain_hook_leaves_reclaim_unconfirmed(fleet: Fleet) -> None:
    async def broken(lora_name: str) -> None:
        raise TimeoutError(f"{lora_name} still has requests")

    backend = VllmBackend(fleet.store, wait_drained=broken)
    try:
        await backend.prepare(fleet.ref0, TARGET_A, A)
        with pytest.raises(BackendAmbiguousError, match="still has requests") as info:
            await backend.reclaim(fleet.ref0, lora_name=NAME_A, reclaim_id="r1")
    finally:
        await backend.aclose()
    assert info.value.details["reason"] == "drain_failed"
    assert fleet.e0.count(EngineOp.UNLOAD) == 0
    assert fleet.e0.held_digest(NAME_A) == A.digest


# --- incarnation ----------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_unreadable_metrics_make_the_incarnation_ambiguous(fleet: Fleet) -> None:
    # Same method and URL as the engine's own route: respx replaces it.
    fleet.router.get(f"{fleet.e0.base_url}/metrics").respond(200, text="not { prometheus")
    with pytest.raises(BackendAmbiguousError, match="unreadable metrics"):
        await fleet.backend.incarnation(fleet.ref0)


# --- metrics --------------------------------------------------------------------------------

# Trimmed from a real vLLM 0.32.0 /metrics page after requests on adapters A2 and B.
REAL_METRICS = """\
# HELP python_info Python platform information
# TYPE python_info gauge
python_info{implementation="CPython",major="3",minor="11",patchlevel="7",version="3.11.7"} 1.0
# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.
# TYPE process_start_time_seconds gauge
process_start_time_seconds 1.79599545475e+09
# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1.7959956558650708e+09
vllm:lora_requests_info{max_lora="2",running_lora_adapters="A2",waiting_lora_adapters="A2"} 1.7959957237706897e+09
vllm:lora_requests_info{max_lora="2",running_lora_adapters="B",waiting_lora_adapters="B,C"} 1.795995655218605e+09
"""


def test_metrics_read_the_start_time_and_only_the_newest_lora_report() -> None:
    metrics = parse_metrics(REAL_METRICS)
    assert metrics.process_start_time == 1795995454.75
    activity = metrics.lora_activity
    assert activity is not None
    assert activity.running == frozenset({"A2"})
    assert activity.busy("A2")
    assert not activity.busy("B")  # B's label set is an older report
    assert not activity.busy("C")


def test_metrics_without_lora_reports_have_no_activity() -> None:
    metrics = parse_metrics("process_start_time_seconds 12.5\n")
    assert metrics == type(metrics)(process_start_time=12.5, lora_activity=None)


@pytest.mark.asyncio
async def test_a_shared_client_is_not_closed_by_the_backend(tmp_path: Path) -> None:
    async with httpx.AsyncClient() as client:
        backend = VllmBackend(tmp_path, wait_drained=drained_at_once, client=client)
        await backend.aclose()
        assert not client.is_closed
