"""An engine or sidecar restart changes the incarnation and is never mistaken for progress."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from agentic_lora.errors import BackendAmbiguousError, BackendRefusedError
from tests.dcs.conftest import Publisher
from tests.dcs.util import BUCKET_BYTES, SidecarProcess, make_snapshot, resend, state_of, target_for

pytestmark = [pytest.mark.dcs, pytest.mark.timeout(60)]


@pytest.mark.asyncio
async def test_engine_restart_changes_the_incarnation_and_fences_messages_for_the_old_one(
    sidecars: dict[str, SidecarProcess], http: httpx.AsyncClient, publisher: Publisher
) -> None:
    e1 = sidecars["E1"]
    snapshot = make_snapshot(seed=41)
    target = target_for(snapshot, "restart-before-begin")
    before = await publisher.backend.incarnation(e1.engine)
    # A Begin prepared against the old engine process (the publisher read it before the restart).
    publisher.edge.before("/begin", lambda: e1.restart_engine(http))

    with pytest.raises(BackendRefusedError) as refused:
        await publisher.backend.prepare(e1.engine, target, snapshot)

    after = await publisher.backend.incarnation(e1.engine)
    assert before != after
    assert before.split("/")[0] == after.split("/")[0] == e1.sidecar_id
    assert refused.value.details["reason"] == "INCARNATION_MISMATCH"
    assert refused.value.details["current"] == after
    assert await e1.attempt(http, target.lora_name, 1) is None


@pytest.mark.asyncio
async def test_engine_restart_between_transfer_and_load_is_a_clean_refusal(
    sidecars: dict[str, SidecarProcess], http: httpx.AsyncClient, publisher: Publisher
) -> None:
    e0 = sidecars["E0"]
    snapshot = make_snapshot(seed=42)
    target = target_for(snapshot, "restart-before-end")
    publisher.edge.before("/end", lambda: e0.restart_engine(http))

    with pytest.raises(BackendRefusedError) as refused:
        await publisher.backend.prepare(e0.engine, target, snapshot)

    assert refused.value.details["reason"] == "ENGINE_RESTARTED"
    engine = await e0.engine_state(http)
    assert target.lora_name not in engine["physical_loads"]
    assert await e0.stash_bytes(http) == 0
    assert await state_of(e0, http, target.lora_name, 1) == "FAILED"


@pytest.mark.asyncio
async def test_engine_restart_right_after_the_load_is_ambiguous_until_cleaned_up(
    sidecars: dict[str, SidecarProcess], http: httpx.AsyncClient, publisher: Publisher
) -> None:
    e1 = sidecars["E1"]
    snapshot = make_snapshot(seed=43)
    target = target_for(snapshot, "restart-after-load")
    await e1.script(http, "load", "restart_after")

    with pytest.raises(BackendAmbiguousError) as ambiguous:
        await publisher.backend.prepare(e1.engine, target, snapshot)

    assert ambiguous.value.details["reason"] == "ENGINE_UNCERTAIN"
    assert await state_of(e1, http, target.lora_name, 1) == "UNCERTAIN"
    assert (e1.store_dir / target.lora_name).is_dir()

    await publisher.backend.cleanup(e1.engine, target)

    assert await state_of(e1, http, target.lora_name, 1) == "CLEANED"
    engine = await e1.engine_state(http)
    assert target.lora_name not in engine["adapters"]
    assert not (e1.store_dir / target.lora_name).exists()


@pytest.fixture
def lone_sidecar(tmp_path: Path) -> Iterator[SidecarProcess]:
    sidecar = SidecarProcess.start("E9", tmp_path / "store")
    try:
        yield sidecar
    finally:
        sidecar.stop()


@pytest.mark.asyncio
async def test_sidecar_restart_changes_the_incarnation_and_refuses_the_old_attempt(
    lone_sidecar: SidecarProcess, http: httpx.AsyncClient
) -> None:
    snapshot = make_snapshot(seed=44)
    target = target_for(snapshot, "sidecar-restart")
    publisher = Publisher({"E9": lone_sidecar}, BUCKET_BYTES)
    try:
        before = await publisher.backend.incarnation(lone_sidecar.engine)
        await publisher.backend.prepare(lone_sidecar.engine, target, snapshot)
        old_begin = publisher.edge.bodies("/begin")[0]
        old_end = publisher.edge.bodies("/end")[0]

        lone_sidecar.stop()
        restarted = SidecarProcess.start("E9", lone_sidecar.store_dir)
        try:
            begin = await resend(http, restarted.url + "/begin", old_begin)
            end = await resend(http, restarted.url + "/end", old_end)
            fresh = Publisher({"E9": restarted}, BUCKET_BYTES)
            try:
                after = await fresh.backend.incarnation(restarted.engine)
            finally:
                await fresh.aclose()
        finally:
            restarted.stop()
    finally:
        await publisher.aclose()

    assert before.split("/")[0] != after.split("/")[0]
    assert begin.status_code == 409
    assert begin.json()["reason"] == "INCARNATION_MISMATCH"
    assert begin.json()["clean"] is True
    # An End that crossed the restart may have loaded through the old sidecar: not clean.
    assert end.status_code == 503
    assert end.json()["reason"] == "INCARNATION_MISMATCH"
    assert end.json()["clean"] is False


@pytest.mark.asyncio
async def test_an_engine_that_cannot_be_reached_at_begin_is_a_clean_refusal(
    sidecars: dict[str, SidecarProcess], http: httpx.AsyncClient, publisher: Publisher
) -> None:
    e0 = sidecars["E0"]
    snapshot = make_snapshot(seed=45)
    target = target_for(snapshot, "engine-unreachable")
    publisher.edge.before("/begin", lambda: e0.script(http, "server_info", "unreachable"))

    with pytest.raises(BackendRefusedError) as refused:
        await publisher.backend.prepare(e0.engine, target, snapshot)

    assert refused.value.details["reason"] == "ENGINE_UNAVAILABLE"
    assert await state_of(e0, http, target.lora_name, 1) is None
