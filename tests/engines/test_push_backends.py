"""What every HTTP backend does alike, against its scripted engine (respx): one suite, run once per
backend. HTTP push talks to SGLang, the vLLM backend to vLLM; what only one of them does is in
``test_http_push.py`` and ``test_vllm_backend.py``."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
import respx
from agentic_lora_http import HttpPushBackend
from agentic_lora_vllm import VllmBackend

from agentic_lora.engines.adapter_backend import RECLAIMED_DIR
from agentic_lora.engines.backends import Backend
from agentic_lora.engines.backends import EngineRef
from agentic_lora.engines.backends import IncarnationRecheck
from agentic_lora.engines.backends import PublicationTarget
from agentic_lora.errors import BackendAmbiguousError
from agentic_lora.errors import BackendRefusedError
from agentic_lora.errors import ConfigurationError
from agentic_lora.foundation.identity import make_lora_name
from agentic_lora.testing.adapters import tiny_snapshot
from agentic_lora.testing.scripted_engine import EngineOp
from agentic_lora.testing.scripted_engine import Fault
from agentic_lora.testing.scripted_engine import FaultKind
from agentic_lora.testing.scripted_engine import ScriptedEngine
from agentic_lora.testing.scripted_harness import sglang_engines
from agentic_lora.testing.scripted_harness import vllm_engines

A = tiny_snapshot(1)
B = tiny_snapshot(2)
NAME_A = make_lora_name("policy_lora", 0, "v1", A.digest)
TARGET_A = PublicationTarget("v1", A.digest, NAME_A, 1)


async def drained_at_once(lora_name: str) -> None:
    """The vLLM drain hook where no request is ever in flight."""


@dataclass(frozen=True)
class Kind:
    """One backend and the engine it talks to."""

    name: str
    make_backend: Callable[[Path], Backend]
    make_engine: Callable[[], ScriptedEngine[Any]]
    #: The engine calls of a probe generation and of the read that yields the incarnation.
    probe: EngineOp
    incarnation_read: EngineOp
    #: A generation request for a LoRA name in the engine's own API (route, body), and the status
    #: the engine answers for a name it does not serve.
    generation: Callable[[str], tuple[str, dict[str, Any]]]
    unknown_name_status: int


KINDS = [
    Kind(
        "http_push",
        HttpPushBackend,
        lambda: sglang_engines(("e0",))[0],
        EngineOp.GENERATE,
        EngineOp.SERVER_INFO,
        lambda name: ("/generate", {"input_ids": [0], "lora_path": name}),
        400,
    ),
    Kind(
        "vllm",
        lambda store: VllmBackend(store, wait_drained=drained_at_once),
        lambda: vllm_engines(("e0",))[0],
        EngineOp.COMPLETION,
        EngineOp.METRICS,
        lambda name: ("/v1/completions", {"model": name, "prompt": [0]}),
        404,
    ),
]


def assert_unloaded_once(engine: ScriptedEngine[Any], store: Path, lora_name: str) -> None:
    """``engine`` physically unloaded ``lora_name`` exactly once and its stored copy is gone."""
    assert engine.physical_unloads[lora_name] == 1
    assert not (store / engine.name / lora_name).exists()


@dataclass
class Push:
    kind: Kind
    backend: Backend
    e0: ScriptedEngine[Any]
    ref0: EngineRef
    store: Path

    def stored(self, lora_name: str = NAME_A) -> Path:
        return self.store / "e0" / lora_name


@pytest_asyncio.fixture(params=KINDS, ids=[k.name for k in KINDS])
async def push(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Push]:
    kind: Kind = request.param
    engine = kind.make_engine()
    with respx.mock(assert_all_called=False) as router:
        engine.mount(router)
        backend = kind.make_backend(tmp_path / "store")
        yield Push(kind, backend, engine, EngineRef("e0", engine.base_url), tmp_path / "store")
        await backend.aclose()


@pytest.mark.parametrize("kind", KINDS, ids=[k.name for k in KINDS])
def test_it_is_a_backend_and_its_store_root_must_be_absolute(kind: Kind, tmp_path: Path) -> None:
    assert isinstance(kind.make_backend(tmp_path), Backend)
    with pytest.raises(ConfigurationError, match="absolute"):
        kind.make_backend(Path("relative/store"))


# --- prepare --------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_prepare_reports_ready_for_exactly_the_target_and_the_engine_read_our_bytes(
    push: Push,
) -> None:
    receipt = await push.backend.prepare(push.ref0, TARGET_A, A)
    assert push.e0.bodies(EngineOp.LOAD)[0]["lora_path"] == str(push.stored())
    assert push.e0.held_digest(NAME_A) == A.digest
    assert push.e0.count(push.kind.probe) == 1  # probed once, after the load
    assert (receipt.engine, receipt.version_id, receipt.digest, receipt.lora_name) == (
        "e0",
        "v1",
        A.digest,
        NAME_A,
    )
    assert receipt.attempt == 1
    assert receipt.incarnation == await push.backend.incarnation(push.ref0)


@pytest.mark.asyncio
async def test_a_repeated_prepare_never_loads_twice(push: Push) -> None:
    first = await push.backend.prepare(push.ref0, TARGET_A, A)
    second = await push.backend.prepare(push.ref0, TARGET_A, A)
    assert first == second
    assert push.e0.physical_loads[NAME_A] == 1
    assert push.e0.count(EngineOp.LOAD) == 1


@pytest.mark.asyncio
async def test_http_200_with_a_failure_body_is_refused_and_nothing_is_held(push: Push) -> None:
    push.e0.script(EngineOp.LOAD, Fault(FaultKind.OK_BUT_FAILED, "cannot add it"))
    with pytest.raises(BackendRefusedError, match="cannot add it"):
        await push.backend.prepare(push.ref0, TARGET_A, A)
    assert not push.e0.holds(NAME_A)
    assert push.e0.count(push.kind.probe) == 0  # never probed, never reported READY


@pytest.mark.asyncio
async def test_a_lost_load_reply_is_ambiguous_and_cleanup_resolves_it(push: Push) -> None:
    push.e0.script(EngineOp.LOAD, Fault(FaultKind.LOSE_REPLY))
    with pytest.raises(BackendAmbiguousError):
        await push.backend.prepare(push.ref0, TARGET_A, A)
    assert push.e0.held_digest(NAME_A) == A.digest  # it did load: the reply was lost
    await push.backend.cleanup(push.ref0, TARGET_A)
    assert not push.e0.holds(NAME_A)
    assert_unloaded_once(push.e0, push.store, NAME_A)


@pytest.mark.asyncio
async def test_a_probe_that_fails_after_the_load_is_ambiguous(push: Push) -> None:
    push.e0.script(push.kind.probe, Fault(FaultKind.SERVER_ERROR))
    with pytest.raises(BackendAmbiguousError, match="does not serve"):
        await push.backend.prepare(push.ref0, TARGET_A, A)
    assert push.e0.held_digest(NAME_A) == A.digest


@pytest.mark.asyncio
async def test_an_unreachable_engine_refuses_before_anything_is_loaded(push: Push) -> None:
    push.e0.script(push.kind.incarnation_read, Fault(FaultKind.UNREACHABLE))
    with pytest.raises(BackendRefusedError, match="unreadable"):
        await push.backend.prepare(push.ref0, TARGET_A, A)
    assert push.e0.count(EngineOp.LOAD) == 0


@pytest.mark.asyncio
async def test_a_snapshot_that_is_not_the_target_is_refused_without_io(push: Push) -> None:
    with pytest.raises(BackendRefusedError, match="digest"):
        await push.backend.prepare(push.ref0, TARGET_A, B)
    assert push.e0.calls == []


@pytest.mark.asyncio
async def test_a_stored_copy_with_other_content_is_refused_before_loading(push: Push) -> None:
    B.write_peft_dir(push.stored())  # wrong bytes under A's name
    with pytest.raises(BackendRefusedError) as info:
        await push.backend.prepare(push.ref0, TARGET_A, A)
    assert info.value.details["reason"] == "manifest_mismatch"
    assert push.e0.calls == []


@pytest.mark.asyncio
async def test_engine_names_must_be_directory_names(push: Push) -> None:
    with pytest.raises(ConfigurationError):
        await push.backend.prepare(EngineRef("../e0", push.e0.base_url), TARGET_A, A)


# --- cleanup --------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_cleanup_of_an_absent_adapter_is_confirmed(push: Push) -> None:
    await push.backend.cleanup(push.ref0, TARGET_A)
    assert push.e0.count(EngineOp.UNLOAD) == 1
    assert push.e0.physical_unloads[NAME_A] == 0


@pytest.mark.asyncio
async def test_a_cleanup_that_overtook_its_prepare_fences_it(push: Push) -> None:
    await push.backend.cleanup(push.ref0, TARGET_A)
    with pytest.raises(BackendRefusedError, match="fenced"):
        await push.backend.prepare(push.ref0, TARGET_A, A)
    assert push.e0.count(EngineOp.LOAD) == 0
    assert not push.stored().exists()
    # The next attempt is a new publication and goes through.
    retry = PublicationTarget("v1", A.digest, NAME_A, 2)
    assert (await push.backend.prepare(push.ref0, retry, A)).attempt == 2


@pytest.mark.asyncio
async def test_a_late_cleanup_of_a_superseded_attempt_touches_nothing(push: Push) -> None:
    await push.backend.prepare(push.ref0, PublicationTarget("v1", A.digest, NAME_A, 2), A)
    await push.backend.cleanup(push.ref0, TARGET_A)  # attempt 1, arriving late
    assert push.e0.holds(NAME_A)
    assert push.e0.count(EngineOp.UNLOAD) == 0
    assert push.stored().is_dir()


@pytest.mark.parametrize("failure", [FaultKind.REFUSE, FaultKind.OK_BUT_FAILED])
@pytest.mark.asyncio
async def test_an_unload_that_fails_leaves_cleanup_unconfirmed(
    push: Push, failure: FaultKind
) -> None:
    await push.backend.prepare(push.ref0, TARGET_A, A)
    push.e0.script(EngineOp.UNLOAD, Fault(failure, "rank 1 failed"))
    with pytest.raises(BackendAmbiguousError, match="not confirmed"):
        await push.backend.cleanup(push.ref0, TARGET_A)
    assert push.e0.held_digest(NAME_A) == A.digest
    assert push.stored().is_dir()


@pytest.mark.asyncio
async def test_unloading_ourselves_is_not_a_restart(push: Push) -> None:
    receipt = await push.backend.prepare(push.ref0, TARGET_A, A)
    await push.backend.cleanup(push.ref0, TARGET_A)
    assert await push.backend.incarnation(push.ref0) == receipt.incarnation


# --- reclaim --------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_reclaim_retried_after_a_lost_receipt_never_unloads_twice(push: Push) -> None:
    await push.backend.prepare(push.ref0, TARGET_A, A)
    push.e0.script(EngineOp.UNLOAD, Fault(FaultKind.LOSE_REPLY))
    with pytest.raises(BackendAmbiguousError):
        await push.backend.reclaim(push.ref0, lora_name=NAME_A, reclaim_id="r1")
    await push.backend.reclaim(push.ref0, lora_name=NAME_A, reclaim_id="r1")
    await push.backend.reclaim(push.ref0, lora_name=NAME_A, reclaim_id="r1")
    assert push.e0.physical_unloads[NAME_A] == 1
    # Lost one, retried once (found absent); the third call was answered from memory.
    assert push.e0.count(EngineOp.UNLOAD) == 2
    assert not push.stored().exists()


@pytest.mark.asyncio
async def test_a_reclaimed_attempt_is_never_loaded_again(push: Push) -> None:
    await push.backend.prepare(push.ref0, TARGET_A, A)
    await push.backend.reclaim(push.ref0, lora_name=NAME_A, reclaim_id="r1")
    # A late request: SGLang would reload a name it loaded once from its cached path (that path
    # is gone); vLLM no longer knows the name.
    route, body = push.kind.generation(NAME_A)
    async with httpx.AsyncClient() as client:
        late = await client.post(push.e0.base_url + route, json=body)
    assert late.status_code == push.kind.unknown_name_status
    # A late prepare of the reclaimed attempt (or an older one) is fenced.
    with pytest.raises(BackendRefusedError, match="fenced"):
        await push.backend.prepare(push.ref0, TARGET_A, A)
    assert push.e0.physical_loads[NAME_A] == 1
    assert not push.stored().exists()


@pytest.mark.asyncio
async def test_a_reclaimed_version_stays_readable_for_a_rollback_and_reloads_as_a_new_attempt(
    push: Push,
) -> None:
    await push.backend.prepare(push.ref0, TARGET_A, A)
    await push.backend.reclaim(push.ref0, lora_name=NAME_A, reclaim_id="r1")
    # Out of the engine's reach, but kept whole for a rollback (verified against its digest).
    assert not push.stored().exists()
    assert (push.store / RECLAIMED_DIR / NAME_A).is_dir()
    stored = await push.backend.stored_snapshot(NAME_A, A.digest)  # type: ignore[attr-defined]
    assert stored is not None
    assert stored.digest == A.digest
    assert await push.backend.stored_snapshot(NAME_A, B.digest) is None  # type: ignore[attr-defined]
    # A rollback's reload is a newer attempt of the same content under the same name.
    reload = PublicationTarget("v1", A.digest, NAME_A, 2)
    receipt = await push.backend.prepare(push.ref0, reload, stored)
    assert (receipt.attempt, push.e0.held_digest(NAME_A)) == (2, A.digest)
    assert push.e0.physical_loads[NAME_A] == 2
    # Reclaimed again, under the new reclaim id: unloaded once more.
    await push.backend.reclaim(push.ref0, lora_name=NAME_A, reclaim_id="r1.1")
    assert push.e0.physical_unloads[NAME_A] == 2
    assert (push.store / RECLAIMED_DIR / NAME_A).is_dir()


@contextlib.asynccontextmanager
async def http_push(
    store: Path, **options: Any
) -> AsyncIterator[tuple[HttpPushBackend, EngineRef]]:
    """An HTTP push backend with ``options`` on one scripted SGLang engine."""
    engine = sglang_engines(("e0",))[0]
    with respx.mock(assert_all_called=False) as router:
        engine.mount(router)
        backend = HttpPushBackend(store, **options)
        try:
            yield backend, EngineRef("e0", engine.base_url)
        finally:
            await backend.aclose()


@pytest.mark.asyncio
async def test_the_reclaimed_store_keeps_the_newest_versions_only(tmp_path: Path) -> None:
    async with http_push(tmp_path / "store", keep_reclaimed=2) as (backend, ref):
        names = []
        for i in range(1, 5):
            snapshot = tiny_snapshot(i)
            name = make_lora_name("policy_lora", 0, f"v{i}", snapshot.digest)
            await backend.prepare(
                ref, PublicationTarget(f"v{i}", snapshot.digest, name, 1), snapshot
            )
            await backend.reclaim(ref, lora_name=name, reclaim_id=f"r{i}")
            names.append(name)
    assert sorted(p.name for p in (tmp_path / "store" / RECLAIMED_DIR).iterdir()) == sorted(
        names[2:]
    )
    with pytest.raises(ConfigurationError) as err:
        HttpPushBackend(tmp_path / "store", keep_reclaimed=-1)
    assert err.value.details["check"] == "keep_reclaimed"


@pytest.mark.asyncio
async def test_without_a_reclaimed_store_a_reclaim_removes_the_copy(tmp_path: Path) -> None:
    async with http_push(tmp_path / "store", keep_reclaimed=0) as (backend, ref):
        await backend.prepare(ref, TARGET_A, A)
        await backend.reclaim(ref, lora_name=NAME_A, reclaim_id="r1")
        assert await backend.stored_snapshot(NAME_A, A.digest) is None
    assert not (tmp_path / "store" / RECLAIMED_DIR).exists()


# --- incarnation ----------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_incarnation_is_stable_and_changes_on_restart(push: Push) -> None:
    first = await push.backend.incarnation(push.ref0)
    assert await push.backend.incarnation(push.ref0) == first
    push.e0.restart()
    assert await push.backend.incarnation(push.ref0) != first


@pytest.mark.asyncio
async def test_a_loaded_adapter_that_vanished_counts_as_a_restart(push: Push) -> None:
    receipt = await push.backend.prepare(push.ref0, TARGET_A, A)
    # Same fingerprint (same process start), but the adapter is gone: an operator's unload.
    del push.e0.adapters[NAME_A]
    after = await push.backend.incarnation(push.ref0)
    assert after != receipt.incarnation
    assert await push.backend.incarnation(push.ref0) == after


@pytest.mark.asyncio
async def test_a_prepare_reads_only_the_listing_while_it_names_every_held_adapter(
    push: Push,
) -> None:
    first = await push.backend.prepare(push.ref0, TARGET_A, A)
    fingerprint_reads = push.e0.count(push.kind.incarnation_read)
    name_b = make_lora_name("policy_lora", 0, "v2", B.digest)
    second = await push.backend.prepare(push.ref0, PublicationTarget("v2", B.digest, name_b, 1), B)
    # A is held and still listed: the listing alone witnesses that no restart happened.
    assert push.e0.count(push.kind.incarnation_read) == fingerprint_reads
    assert second.incarnation == first.incarnation
    # The health probe (and every other incarnation read) still reads the fingerprint.
    assert await push.backend.incarnation(push.ref0) == first.incarnation
    assert push.e0.count(push.kind.incarnation_read) == fingerprint_reads + 1


@pytest.mark.asyncio
async def test_a_restart_before_a_prepare_is_seen_through_the_listing(push: Push) -> None:
    first = await push.backend.prepare(push.ref0, TARGET_A, A)
    push.e0.restart()
    name_b = make_lora_name("policy_lora", 0, "v2", B.digest)
    second = await push.backend.prepare(push.ref0, PublicationTarget("v2", B.digest, name_b, 1), B)
    # The restarted engine lists nothing of ours: the fingerprint is read and decides.
    assert second.incarnation != first.incarnation
    assert second.incarnation == await push.backend.incarnation(push.ref0)
    assert push.e0.holds(name_b)


@pytest.mark.asyncio
async def test_a_recheck_reads_the_listing_and_still_sees_a_restart(push: Push) -> None:
    assert isinstance(push.backend, IncarnationRecheck)
    # Nothing held yet: the listing proves nothing, the fingerprint is read.
    before = push.e0.count(push.kind.incarnation_read)
    first = await push.backend.recheck_incarnation(push.ref0)
    assert push.e0.count(push.kind.incarnation_read) == before + 1
    receipt = await push.backend.prepare(push.ref0, TARGET_A, A)
    assert receipt.incarnation == first
    reads = push.e0.count(push.kind.incarnation_read)
    assert await push.backend.recheck_incarnation(push.ref0) == receipt.incarnation
    assert push.e0.count(push.kind.incarnation_read) == reads
    push.e0.restart()
    after = await push.backend.recheck_incarnation(push.ref0)
    assert after != receipt.incarnation
    assert after == await push.backend.incarnation(push.ref0)
